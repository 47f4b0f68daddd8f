"""An agent program as meshrl's gateway starts it (`agent.command`): a plain OpenAI-SDK tool loop
that knows nothing about meshrl. It reads the prompt as JSON on stdin, talks to the policy
through OPENAI_BASE_URL / OPENAI_API_KEY (the SDK reads both), runs the calculator tool `add`
itself, and exits 0: the reward service then scores its last answer. An agent that computes its
own reward would POST {"reward": x} to $OPENAI_BASE_URL/../finish instead (see --reward-self).

    meshrl train configs/examples/tool_add.yaml actor_rollout_ref.rollout.multi_turn.enable=false \\
        'agent.command=[python, examples/gateway_agent/tool_add_agent.py]'
"""

from __future__ import annotations

import json
import os
import sys

import httpx
import openai

TOOLS = [{
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]},
    },
}]


def add(arguments: str) -> str:
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def main() -> int:
    prompt = json.load(sys.stdin)
    client = openai.OpenAI(max_retries=2)
    messages: list[dict] = list(prompt["messages"])
    answer = ""
    for _ in range(3):
        resp = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        answer = msg.content or ""
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": add(call.function.arguments)})
    if "--reward-self" in sys.argv:
        expected = sum(int(x) for x in prompt["messages"][-1]["content"].rstrip("=").split("+"))
        base = os.environ["OPENAI_BASE_URL"].rsplit("/v1", 1)[0]
        httpx.post(f"{base}/finish", json={"reward": float(answer.strip() == str(expected))},
                   headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}).raise_for_status()
    return 0


if __name__ == "__main__":
    sys.exit(main())
