"""An agent *service* for meshrl's gateway (`agent.endpoint`): one long-lived process that plays
the built-in tool task (`configs/examples/tool_add_gateway.yaml`) for every sample meshrl POSTs
to it, with the official `openai` SDK (AsyncOpenAI) and nothing of meshrl. Starting a program per
sample (`agent.command`) costs about a second of CPU per sample; here a sample costs its HTTP calls.

    python examples/gateway_agent/tool_add_service.py --port 8931 &   # prints its URL, then serves
    meshrl train configs/examples/tool_add_gateway.yaml               # agent.endpoint: that URL

POST /run {prompt, base_url, api_key, session_id} runs one sample and answers when it is done
(200), or 500 with the error (meshrl then returns the group's lease; its prompt is re-queued).
The tool loop is the in-process one's (services/rollout/agent/loop.py with
configs/examples/tool_add_tools.yaml), so the two runs are comparable:
- the tool schema is the tool YAML's, byte for byte (the chat template renders it);
- at most `--max-turns` (3) model calls; no budget is asked for: the gateway gives each call what
  is left of the sample's data.max_response_length, as the loop does, and a call refused because
  the budget is spent (400 context_length_exceeded) ends the sample like the loop's `length`;
- a turn cut by the budget (finish_reason length), or one without tool calls, ends the sample;
- `--max-parallel-calls` (1) calls run per turn, the others are answered with the loop's error; a
  call's error (bad arguments, unknown tool) is answered with the loop's error text, and every
  answer is cut to `--max-tool-response-length` (64) characters the loop's way (middle);
- the sample ends with `POST <base>/finish {}`: no reward, so meshrl's reward service scores the
  last answer exactly as it scores the in-process loop's (reward_source reward_service), and the
  ground truth never leaves meshrl.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from typing import Any

import httpx2
import openai
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

# configs/examples/tool_add_tools.yaml's schema as meshrl's tool loader dumps it (a unit test keeps them equal).
TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers and return their sum.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "description": "the first addend"},
                           "b": {"type": "integer", "description": "the second addend"}},
            "required": ["a", "b"],
        },
        "strict": False,
    },
}]


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    raise ValueError(f"{name} must be an integer, got {value!r}")


def run_tool(name: str, arguments: str) -> str:
    """The calculator's answer to one call, or the error text the in-process loop would send."""
    if name != "add":
        return f"Error: unknown tool {name!r}; available tools: ['add']"
    try:
        params = json.loads(arguments) if arguments.strip() else {}
        if not isinstance(params, dict):
            raise ValueError(f"expected a JSON object, got {type(params).__name__}")
    except ValueError as exc:
        return f"Error: invalid arguments for add: {exc}"
    try:
        unknown = sorted(set(params) - {"a", "b"})
        if unknown or "a" not in params or "b" not in params:
            raise ValueError(f"add takes exactly the arguments a and b, got {sorted(params)}")
        return str(_integer(params["a"], "a") + _integer(params["b"], "b"))
    except ValueError as exc:
        return f"Error when executing tool add: {exc}"


def truncate_middle(text: str, limit: int) -> str:
    """The loop's `tool_response_truncate_side: middle`."""
    if len(text) <= limit:
        return text
    half = limit // 2  # verl's middle cut: limit // 2 characters of each end
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


class ToolAddAgent:
    """The tool loop, one sample per `play` call; one HTTP connection pool for every session."""

    def __init__(self, *, max_turns: int = 3, max_parallel_calls: int = 1, max_tool_response_length: int = 64) -> None:
        self.max_turns = max_turns
        self.max_parallel_calls = max_parallel_calls
        self.max_tool_response_length = max_tool_response_length
        # The SDK's own HTTP client class (openai 3 builds on httpx2), one pool for every session.
        self.http = openai.DefaultAsyncHttpxClient(timeout=600, limits=httpx2.Limits(max_connections=256,
                                                                                     max_keepalive_connections=64))
        self.counters = {"samples": 0, "failed": 0, "calls": 0, "tool_calls": 0, "budget_spent": 0}

    async def play(self, prompt: dict[str, Any], base_url: str, api_key: str) -> None:
        # max_retries=0: a refused call (409: the policy moved on, the group is re-queued) must not be retried.
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=self.http, max_retries=0)
        messages: list[dict[str, Any]] = list(prompt["messages"])
        for turn in range(self.max_turns):
            try:
                resp = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            except openai.BadRequestError as exc:
                if exc.code != "context_length_exceeded":
                    raise
                self.counters["budget_spent"] += 1  # the loop's `length`: what the agent added filled the budget
                break
            self.counters["calls"] += 1
            choice = resp.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            calls = choice.message.tool_calls or []
            if choice.finish_reason == "length" or not calls or turn == self.max_turns - 1:
                break
            self.counters["tool_calls"] += len(calls)
            for i, call in enumerate(calls):
                fn = getattr(call, "function", None)
                if i >= self.max_parallel_calls:
                    text = (f"Error: more than {self.max_parallel_calls} tool calls in one turn; this call was not run "
                            f"(max_parallel_calls={self.max_parallel_calls})")
                elif fn is None:
                    text = "Error: unknown tool ''; available tools: ['add']"
                else:
                    text = run_tool(fn.name, fn.arguments)
                # The loop cuts a tool's answer, never an error text (verl); an answer is digits.
                if not text.startswith("Error"):
                    text = truncate_middle(text, self.max_tool_response_length)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        finish = await self.http.post(f"{base_url.rsplit('/v1', 1)[0]}/finish", json={},
                                      headers={"Authorization": f"Bearer {api_key}"})
        finish.raise_for_status()
        self.counters["samples"] += 1


def build_app(agent: ToolAddAgent) -> FastAPI:
    app = FastAPI(title="tool_add agent", docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/run")
    async def run(request: Request) -> JSONResponse:
        body = await request.json()
        try:
            await agent.play(body["prompt"], body["base_url"], body["api_key"])
        except Exception as exc:  # noqa: BLE001 - the sample failed: meshrl re-queues its prompt
            agent.counters["failed"] += 1
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"[:500]}, status_code=500)
        return JSONResponse({"status": "finished", "session_id": body.get("session_id")})

    @app.get("/status")
    async def status() -> dict[str, int]:
        return agent.counters

    return app


async def serve(host: str, port: int, agent: ToolAddAgent) -> None:
    server = uvicorn.Server(uvicorn.Config(build_app(agent), host=host, port=port, log_level="warning",
                                           access_log=False, lifespan="off", timeout_keep_alive=30))
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            return
        await asyncio.sleep(0.02)
    bound = int(server.servers[0].sockets[0].getsockname()[1])
    # The first line of stdout: what to set agent.endpoint to (a caller passing --port 0 reads it).
    print(f"http://{host}:{bound}/run", flush=True)
    try:
        await task
    finally:
        with contextlib.suppress(Exception):
            await agent.http.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8931, help="0: any free port (printed)")
    p.add_argument("--max-turns", type=int, default=3, help="multi_turn.max_assistant_turns of the in-process loop")
    p.add_argument("--max-parallel-calls", type=int, default=1, help="multi_turn.max_parallel_calls")
    p.add_argument("--max-tool-response-length", type=int, default=64, help="multi_turn.max_tool_response_length")
    a = p.parse_args(argv)
    agent = ToolAddAgent(max_turns=a.max_turns, max_parallel_calls=a.max_parallel_calls,
                         max_tool_response_length=a.max_tool_response_length)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(a.host, a.port, agent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
