"""`meshrl bench gateway`, part two: many agent sessions at once through the gateway.

    64 agents (official `openai` SDK, AsyncOpenAI)  ──HTTP, loopback──►  gateway (uvicorn)
      each: 3 chat calls with a tool (`add`); a tool call the policy makes is answered with a tool
            message, otherwise the agent adds a user turn; then POST /finish {"reward"}
    groups of `group_size` samples (one lease each) played concurrently by GatewayAgent.play
      └► one transformers engine (tiny Qwen3, random weights), continuous batching

A session counts as ok only when its /finish was accepted (HTTP 200) and its group came back with
its trajectory holding exactly what the SDK was given: one policy run per call, of the call's
`usage.completion_tokens` tokens, with the logprobs the SDK saw. Anything else (a raised call, a
refused finish, a group that failed, a trajectory that disagrees) counts as failed, with its reason.
Per-call latency is client-side (SDK call to parsed response), under that concurrency.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections import Counter
from typing import Any

from meshrl.v1 import common_pb2
from services.environment.builtin import AddTool
from services.environment.tools import OpenAIFunctionToolSchema

CALCULATOR = AddTool({}, OpenAIFunctionToolSchema.model_validate({
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]},
    },
}))
"""The built-in task's calculator (services/environment/builtin.py), answering the agents' calls."""
TOOLS = [CALCULATOR.tool_schema.model_dump(exclude_none=True)]


async def _add(arguments: str) -> str:
    try:
        params = json.loads(arguments or "{}")
        if not isinstance(params, dict):
            raise TypeError(f"expected a JSON object, got {type(params).__name__}")
        response, _, _ = await CALCULATOR.execute("bench", params)
    except (ValueError, TypeError) as exc:
        return f"error: {exc}"
    return response if isinstance(response, str) else response.text or ""


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] if s else float("nan")


def _policy_runs(r: common_pb2.Response) -> list[tuple[int, int]]:
    starts = [*r.turn_starts, len(r.token_ids)]
    return [(a, b) for a, b in itertools.pairwise(starts) if a < b and r.loss_mask[a]]


async def run_sessions(tok: Any, model: Any, *, sessions: int, group_size: int, calls_per_session: int,
                       max_tokens: int, seed: int, sabotage: int = 0) -> dict[str, Any]:
    """`sabotage` agents POST /finish with a wrong key (401): how a test sees that the counts come
    from outcomes (those sessions fail, and their groups' other samples with them: a failed sample
    returns its whole lease)."""
    import httpx
    import openai

    from services.rollout.engines.base import SamplingSpec
    from services.rollout.engines.transformers_engine import TransformersEngine
    from services.rollout.gateway import GatewayAgent, GatewayLimits, GatewaySettings, SessionRegistry
    from services.rollout.gateway.app import GatewayServer, build_app

    max_model_len = 1024
    engine = TransformersEngine(model, tok, max_num_seqs=max(1, min(sessions, 64)), max_model_len=max_model_len,
                                seed=seed)
    await engine.start()
    # what each agent saw, by (prompt_id, sample_index): per call (completion_tokens, logprobs)
    seen: dict[tuple[str, int], list[tuple[int, list[float]]]] = {}
    errors: dict[tuple[str, int], str] = {}
    latencies: list[float] = []
    tool_round_trips = 0
    sabotaged = {(f"bench-g{k // group_size}", k % group_size) for k in range(min(sabotage, sessions))}

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        me = (prompt["prompt_id"], prompt["sample_index"])
        seen[me] = []
        try:
            await session(me, url, key, prompt["messages"])
        except Exception as exc:
            errors.setdefault(me, f"a call failed: {type(exc).__name__}")
            raise

    async def session(me: tuple[str, int], url: str, key: str, first: list[Any]) -> None:
        nonlocal tool_round_trips
        calls = seen[me]
        client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
        try:
            messages: list[Any] = list(first)
            for k in range(calls_per_session):
                t = time.perf_counter()
                resp = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                                            max_tokens=max_tokens, logprobs=True)
                latencies.append(time.perf_counter() - t)
                choice = resp.choices[0]
                assert resp.usage is not None and choice.logprobs is not None and choice.logprobs.content is not None
                calls.append((resp.usage.completion_tokens, [x.logprob for x in choice.logprobs.content]))
                if k == calls_per_session - 1:
                    break
                messages.append(choice.message.model_dump(exclude_none=True))
                if choice.message.tool_calls:
                    for call in choice.message.tool_calls:
                        fn = getattr(call, "function", None)
                        messages.append({"role": "tool", "tool_call_id": call.id,
                                         "content": await _add(fn.arguments if fn is not None else "{}")})
                        tool_round_trips += 1
                else:
                    messages.append({"role": "user", "content": f"Use the add tool, step {k + 1}."})
        finally:
            await client.close()
        auth = "wrong-key" if me in sabotaged else key
        async with httpx.AsyncClient(timeout=600) as c:
            # Once the last sample's /finish lands, play() ends the group and cancels the agents, maybe
            # before this response is read: whether a finish was accepted is told by the group coming
            # back (play returns only when every sample finished), a refusal by this status.
            r = await c.post(url.rsplit("/v1", 1)[0] + "/finish", json={"reward": 1.0},
                             headers={"Authorization": f"Bearer {auth}"})
            if r.status_code != 200:
                errors[me] = f"finish refused: HTTP {r.status_code}"
                r.raise_for_status()

    registry = SessionRegistry(tok, GatewayLimits(max_model_len=max_model_len, response_budget=max_model_len - 128,
                                                  max_calls_per_sample=calls_per_session + 1))
    ga = GatewayAgent(tok, registry, GatewaySettings(command=None, endpoint=None, sample_timeout_s=3600,
                                                     max_concurrent=max(1, sessions), launch=agent))
    server = GatewayServer(build_app(registry), "127.0.0.1", 0)
    port = await server.start()
    ga.base_url = lambda sid: f"http://127.0.0.1:{port}/sessions/{sid}/v1"
    sizes = [min(group_size, sessions - a) for a in range(0, sessions, group_size)]

    async def play(g: int, n: int) -> common_pb2.TrajectoryGroup:
        prompt = common_pb2.Prompt(prompt_id=f"bench-g{g}", messages=[common_pb2.ChatMessage(
            role="user", content=f"What is {10 + g}+{20 + g}? Use the add tool.")])
        return await ga.play(prompt, SamplingSpec(n=n, max_tokens=max_tokens), f"bench/g{g}", f"lease-{g}", "bench",
                             engine.generate, cancelled=lambda: False, version=lambda: engine.version)

    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(play(g, n) for g, n in enumerate(sizes)), return_exceptions=True)
    finally:
        wall = time.perf_counter() - t0
        await server.stop()
        await engine.close()

    reasons: Counter[str] = Counter()
    ok = 0
    for g, (n, res) in enumerate(zip(sizes, results, strict=True)):
        for i in range(n):
            me = (f"bench-g{g}", i)
            why = _check(me, res, seen.get(me), errors.get(me))
            if why is None:
                ok += 1
            else:
                reasons[why] += 1
    lat_ms = [x * 1000 for x in latencies]
    return {
        "sessions": sessions,
        "sessions_ok": ok,
        "sessions_failed": sessions - ok,
        "sessions_failed_reasons": dict(reasons),
        "sessions_wall_s": round(wall, 3),
        "sessions_per_s": round(ok / wall, 3) if wall > 0 else 0.0,
        "sessions_calls": len(latencies),
        "sessions_tool_round_trips": tool_round_trips,
        "sessions_call_ms": {"p50": round(_pct(lat_ms, 0.5), 3), "p99": round(_pct(lat_ms, 0.99), 3)},
        "sessions_workload": {"group_size": group_size, "groups": len(sizes), "calls_per_session": calls_per_session,
                              "max_tokens": max_tokens, "client": "openai.AsyncOpenAI, one per session",
                              "engine_slots": max(1, min(sessions, 64))},
    }


def _check(me: tuple[str, int], res: Any, calls: list[tuple[int, list[float]]] | None, error: str | None) -> str | None:
    """None when the session came out whole; else why not (a reason class, for the counts)."""
    if calls is None:
        return "agent never started"
    if error is not None:
        return error
    if isinstance(res, BaseException):
        return f"group failed: {type(res).__name__}"
    by_index = {r.sample_index: r for r in res.responses}
    r = by_index.get(me[1])
    if r is None:
        return "trajectory missing"
    runs = _policy_runs(r)
    if [b - a for a, b in runs] != [n for n, _ in calls]:
        return "policy runs differ from the calls' completion_tokens"
    for (a, b), (_, lps) in zip(runs, calls, strict=True):
        if any(not math.isclose(x, y, abs_tol=1e-4) for x, y in zip(r.logprobs[a:b], lps, strict=True)):
            return "logprobs differ from what the SDK saw"
    return None
