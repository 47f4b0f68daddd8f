"""`meshrl bench gateway`: what a call through the OpenAI-compatible gateway costs over calling
the engine directly, measured in the same run on the same engine.

    direct   engine.generate(prompt ids)                          (the agent loop's path)
    gateway  HTTP POST /sessions/<id>/v1/chat/completions         (an agent's path: auth, JSON,
             └ render + tokenize the messages, engine.generate,    recording, parsing, JSON out)
               record tokens, parse tool calls, respond

Real parts: the transformers engine with the tiny Qwen3 (random weights), the gateway's uvicorn
server on loopback, an httpx client (keep-alive). Calls run one at a time, so latencies are
service times, not queueing. Rounds alternate direct / gateway (order flipped every round) so
drift in the machine's load hits both. Per gateway call, `overhead` = client latency minus the
engine's own time inside that call, and `gateway_over_engine` = client latency / engine time of
the same call; the direct calls' p50/p99 are the baseline (a random policy's completions end at
EOS at random, so compare their lengths: `*_tokens_mean`).
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import time
from typing import Any

import torch

from services.common.tiny import build_tiny_model, build_tokenizer


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def _run(tok: Any, model: Any, *, calls: int, rounds: int, max_tokens: int, seed: int) -> dict[str, list[float]]:
    import httpx

    from meshrl.v1 import common_pb2
    from services.rollout.agent.chat import ChatRenderer
    from services.rollout.engines.base import GenerationRequest, SampleOutput, SamplingSpec
    from services.rollout.engines.transformers_engine import TransformersEngine
    from services.rollout.gateway import GatewayAgent, GatewayLimits, GatewaySettings, SessionRegistry
    from services.rollout.gateway.app import GatewayServer, build_app

    engine = TransformersEngine(model, tok, max_num_seqs=8, max_model_len=512, seed=seed)
    await engine.start()
    messages = [{"role": "user", "content": "What is 123+456? Answer with the number."}]
    prompt_ids = ChatRenderer(tok).prompt_ids(messages)
    out: dict[str, list[float]] = {"direct_s": [], "direct_tokens": [], "gateway_s": [], "gateway_engine_s": [],
                                   "overhead_s": [], "gateway_tokens": []}
    engine_time: list[float] = []

    async def timed_generate(req: GenerationRequest) -> list[SampleOutput]:
        t = time.perf_counter()
        res = await engine.generate(req)
        engine_time.append(time.perf_counter() - t)
        return res

    # The run's max_tokens is the engine's: no stop string, no EOS early for most samples of a random
    # model; the same spec on both paths.
    async def direct(k: int) -> None:
        spec = SamplingSpec(n=1, temperature=1.0, max_tokens=max_tokens)
        t = time.perf_counter()
        (res,) = await engine.generate(GenerationRequest(f"direct-{k}", list(prompt_ids), spec))
        out["direct_s"].append(time.perf_counter() - t)
        out["direct_tokens"].append(float(len(res)))

    async def gateway_calls(url: str, key: str, _: dict[str, Any]) -> None:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            for r in range(rounds):
                first_direct = r % 2 == 0
                for phase in ((0, 1) if first_direct else (1, 0)):
                    for k in range(calls):
                        if phase == 0:
                            await direct(r * calls + k)
                            continue
                        before = len(engine_time)
                        t = time.perf_counter()
                        resp = await client.post(f"{url}/chat/completions",
                                                 json={"model": "m", "messages": messages, "max_tokens": max_tokens})
                        dt = time.perf_counter() - t
                        resp.raise_for_status()
                        e = sum(engine_time[before:])
                        out["gateway_s"].append(dt)
                        out["gateway_engine_s"].append(e)
                        out["overhead_s"].append(dt - e)
                        out["gateway_tokens"].append(float(resp.json()["usage"]["completion_tokens"]))
            await client.post(url.rsplit("/v1", 1)[0] + "/finish", json={"reward": 0.0})

    registry = SessionRegistry(tok, GatewayLimits(max_model_len=512, response_budget=max_tokens,
                                                  max_calls_per_sample=calls * rounds + 1))
    ga = GatewayAgent(tok, registry, GatewaySettings(command=None, endpoint=None, sample_timeout_s=3600,
                                                     max_concurrent=1, launch=gateway_calls))
    server = GatewayServer(build_app(registry), "127.0.0.1", 0)
    port = await server.start()
    ga.base_url = lambda sid: f"http://127.0.0.1:{port}/sessions/{sid}/v1"
    try:
        # warm-up: first forward passes, first HTTP connection
        for k in range(3):
            await direct(-1 - k)
        out["direct_s"].clear()
        out["direct_tokens"].clear()
        prompt = common_pb2.Prompt(prompt_id="bench", messages=[common_pb2.ChatMessage(role=messages[0]["role"], content=messages[0]["content"])])
        await ga.play(prompt, SamplingSpec(n=1, max_tokens=max_tokens), "bench/g", "bench", "bench", timed_generate,
                      cancelled=lambda: False, version=lambda: 0)
    finally:
        await server.stop()
        await engine.close()
    return out


def run_benchmark(*, calls: int = 50, rounds: int = 4, max_tokens: int = 16, seed: int = 0, sessions: int = 64,
                  group_size: int = 8, calls_per_session: int = 3, sabotage: int = 0) -> dict[str, Any]:
    """`sabotage`: agents that finish with a wrong key (tests: sessions_failed counts real outcomes)."""
    from .sessions_bench import run_sessions

    torch.manual_seed(seed)
    tok = build_tokenizer(tools=True)
    model = build_tiny_model("qwen3", tok, seed=seed)
    r = asyncio.run(_run(tok, model, calls=calls, rounds=rounds, max_tokens=max_tokens, seed=seed))
    concurrent = (asyncio.run(run_sessions(tok, model, sessions=sessions, group_size=group_size,
                                           calls_per_session=calls_per_session, max_tokens=max_tokens, seed=seed,
                                           sabotage=sabotage))
                  if sessions > 0 else {})

    def ms(values: list[float], q: float) -> float:
        return round(_pct(values, q) * 1000, 3)

    ratio = [g / e for g, e in zip(r["gateway_s"], r["gateway_engine_s"], strict=True)]
    return {
        "benchmark": "gateway",
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "workload": {"calls_per_round": calls, "rounds": rounds, "max_tokens": max_tokens, "engine": "transformers",
                     "model": "tiny qwen3 (random)", "client": "httpx keep-alive, one call at a time"},
        "direct_ms": {"p50": ms(r["direct_s"], 0.5), "p99": ms(r["direct_s"], 0.99)},
        "direct_tokens_mean": round(statistics.mean(r["direct_tokens"]), 2),
        "gateway_ms": {"p50": ms(r["gateway_s"], 0.5), "p99": ms(r["gateway_s"], 0.99)},
        "gateway_tokens_mean": round(statistics.mean(r["gateway_tokens"]), 2),
        "gateway_engine_ms": {"p50": ms(r["gateway_engine_s"], 0.5), "p99": ms(r["gateway_engine_s"], 0.99)},
        "gateway_overhead_ms": {"p50": ms(r["overhead_s"], 0.5), "p99": ms(r["overhead_s"], 0.99)},
        "gateway_over_engine_p50": round(_pct(ratio, 0.5), 3),
        "gateway_over_engine_p99": round(_pct(ratio, 0.99), 3),
        # the names for gateway_overhead_ms.p50 / .p99
        "p50_overhead_ms": ms(r["overhead_s"], 0.5),
        "p99_overhead_ms": ms(r["overhead_s"], 0.99),
        **concurrent,
    }
