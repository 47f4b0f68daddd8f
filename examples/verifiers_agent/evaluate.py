"""Evaluate examples/verifiers_agent/addition_env.py against an OpenAI-compatible endpoint with
verifiers' own `env.evaluate` (its chat-completions client, its rubric), and print one JSON object:
`mean_reward` and, per example, the question, the answer, the last assistant message and the
reward. Against a meshrl gateway session (OPENAI_BASE_URL / OPENAI_API_KEY, or --base-url /
--api-key), every call of every example goes through that session; --finish then ends the session
with the mean reward. In .venv-verifiers:

    .venv-verifiers/bin/python examples/verifiers_agent/evaluate.py --num-examples 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from addition_env import load_environment
from agent import gateway_client


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"), help="the endpoint (default: $OPENAI_BASE_URL)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="its key (default: $OPENAI_API_KEY)")
    ap.add_argument("--model", default="policy", help="the model name the endpoint serves")
    ap.add_argument("--num-examples", type=int, default=8, help="how many of the environment's examples")
    ap.add_argument("--max-concurrent", type=int, default=1,
                    help="rollouts in flight (one gateway session holds one conversation at a time: keep 1 there)")
    ap.add_argument("--finish", action="store_true", help="POST {reward: mean} to the session's /finish afterwards")
    args = ap.parse_args()
    if not args.base_url or not args.api_key:
        ap.error("set --base-url and --api-key (or OPENAI_BASE_URL and OPENAI_API_KEY)")
    env = load_environment(num_examples=args.num_examples)
    client = gateway_client(args.base_url, args.api_key)
    try:
        res = await env.evaluate(client, args.model, sampling_args={}, num_examples=args.num_examples,
                                 rollouts_per_example=1, max_concurrent=args.max_concurrent,
                                 on_start=lambda *a, **k: None, on_progress=lambda *a, **k: None)  # no tqdm bar on stderr
    finally:
        await client.close()
    examples = []
    for out in sorted(res["outputs"], key=lambda o: o["example_id"]):
        last = env.parser.parse_answer(out["completion"])
        examples.append({"example_id": out["example_id"], "question": out["prompt"][-1]["content"]
                         if isinstance(out["prompt"][-1], dict) else out["prompt"][-1].content,
                         "answer": out.get("answer"), "last_answer": last, "reward": float(out["reward"]),
                         "turns": sum(1 for m in out["completion"] or [] if _role(m) == "assistant"),
                         "error": str(out["error"]) if out.get("error") else None})
    mean = sum(e["reward"] for e in examples) / max(1, len(examples))
    print(json.dumps({"mean_reward": mean, "num_examples": len(examples), "examples": examples}))
    if args.finish:
        async with httpx.AsyncClient() as c:
            r = await c.post(args.base_url.rsplit("/v1", 1)[0] + "/finish", json={"reward": mean},
                             headers={"Authorization": f"Bearer {args.api_key}"})
            r.raise_for_status()
    return 0


def _role(m: object) -> str | None:
    return m.get("role") if isinstance(m, dict) else getattr(m, "role", None)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
