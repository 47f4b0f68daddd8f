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
from openai import AsyncOpenAI, BadRequestError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from addition_env import input_from_prompt, load_environment


def completion_messages(completion: Any) -> list[dict[str, Any]]:
    """The completion's messages as plain dicts (role, content, tool calls' names/arguments)."""
    out = []
    for m in completion or []:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        out.append({k: d[k] for k in ("role", "content", "tool_calls") if k in d})
    return out


class GatewayClient(vf.OpenAIChatCompletionsClient):
    """verifiers' chat-completions client, plus: the gateway's 400 `context_length_exceeded` (the
    sample's response budget is spent, or the context is full) is verifiers' OverlongPromptError,
    which ends the rollout as truncated and lets the rubric score it. verifiers recognizes an
    overlong prompt by phrases in the error text, not by OpenAI's error code."""

    async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_native_response(*args, **kwargs)
        except BadRequestError as exc:
            if exc.code == "context_length_exceeded":
                raise vf.OverlongPromptError(str(exc)) from exc
            raise


def gateway_client(base_url: str, api_key: str) -> GatewayClient:
    return GatewayClient(AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))


async def play(prompt: dict[str, Any], base_url: str, api_key: str, env: vf.Environment | None = None) -> float:
    """One sample: verifiers' rollout of the leased prompt through the session, scored by the
    rubric, the reward reported to the session's /finish. What the policy did is scored, an empty
    answer included (verifiers' ModelError: the rubric gives it 0); anything else that stops the
    rollout (the gateway refusing a call, a tool set to stop on errors) raises, the sample fails
    and meshrl returns the lease: a failure never scores zero."""
    env = env or load_environment(num_examples=1)
    client = gateway_client(base_url, api_key)
    try:
        state = await env.rollout(input_from_prompt(prompt), client, "policy", {})
        error = state.get("error")
        if error is not None and not isinstance(error, vf.ModelError):
            raise RuntimeError(f"verifiers rollout failed: {error!r}")
        await env.rubric.score_rollout(state)
        await env.rubric.cleanup(state)
    finally:
        await client.close()
    reward = float(state["reward"])
    if log := os.environ.get("VERIFIERS_AGENT_LOG"):
        record = {"session_id": prompt.get("session_id"), "prompt_id": prompt.get("prompt_id"),
                  "sample_index": prompt.get("sample_index"), "question": prompt["messages"][-1]["content"],
                  "answer": state.get("answer"), "completion": completion_messages(state.get("completion")),
                  "truncated": bool(state.get("is_truncated")), "error": repr(error) if error else None,
                  "reward": reward}
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
