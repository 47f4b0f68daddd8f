"""A verifiers environment as a meshrl agent program (`agent.command`): each sample is one
rollout of examples/verifiers_agent/addition_env.py, played by verifiers' own machinery
(`env.run_rollout` with its OpenAI chat-completions client on OPENAI_BASE_URL / OPENAI_API_KEY,
the gateway session meshrl made for the sample), scored by the environment's rubric; the rubric's
reward goes to POST $OPENAI_BASE_URL/../finish. Run with .venv-verifiers' interpreter:

    scripts/setup_verifiers.sh
    meshrl train configs/examples/tool_add.yaml actor_rollout_ref.rollout.multi_turn.enable=false \\
        'agent.command=[.venv-verifiers/bin/python, examples/verifiers_agent/agent.py]'

With VERIFIERS_AGENT_LOG set, each rollout also appends one JSON line (session, question, answer,
completion text, reward) there: what verifiers saw, for tests and inspection."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import verifiers as vf
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from addition_env import input_from_prompt, load_environment


def completion_messages(completion: Any) -> list[dict[str, Any]]:
    """The completion's messages as plain dicts (role, content, tool calls' names/arguments)."""
    out = []
    for m in completion or []:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        out.append({k: d[k] for k in ("role", "content", "tool_calls") if k in d})
    return out


async def play(prompt: dict[str, Any], base_url: str, api_key: str, env: vf.Environment | None = None) -> float:
    """One sample: verifiers' rollout of the leased prompt through the session, scored by the
    rubric, the reward reported to the session's /finish. Raises when the rollout failed (the
    sample then fails and meshrl returns the lease; a failure never scores zero)."""
    env = env or load_environment(num_examples=1)
    client = vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))
    try:
        out = await env.run_rollout(input_from_prompt(prompt), client, "policy", {})
    finally:
        await client.close()
    if out.get("error"):
        raise RuntimeError(f"verifiers rollout failed: {out['error']}")
    reward = float(out["reward"])
    if log := os.environ.get("VERIFIERS_AGENT_LOG"):
        record = {"session_id": prompt.get("session_id"), "prompt_id": prompt.get("prompt_id"),
                  "sample_index": prompt.get("sample_index"),
                  "question": prompt["messages"][-1]["content"], "answer": out.get("answer"),
                  "completion": completion_messages(out.get("completion")), "reward": reward}
        with open(log, "a") as f:  # one short line per write: appends from concurrent agents stay whole
            f.write(json.dumps(record) + "\n")
    async with httpx.AsyncClient() as c:
        r = await c.post(base_url.rsplit("/v1", 1)[0] + "/finish", json={"reward": reward},
                         headers={"Authorization": f"Bearer {api_key}"})
        r.raise_for_status()
    return reward


async def main() -> int:
    prompt = json.load(sys.stdin)
    try:
        await play(prompt, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"])
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
