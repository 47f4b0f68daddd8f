"""`meshrl bench agent`: does a slow environment stall generation? Policy tokens/s of multi-turn
trajectories whose environment answers at once, against the same workload whose environment
sleeps `delay_ms` per call, in the same run.

    groups (bounded concurrency, like a rollout replica's leases)
      └─ AgentLoop.run_group ── n trajectories, each: generate a turn ──> Step over gRPC ──> ...
                                      │ transformers engine (continuous batching)
                                      └ EnvironmentServer on loopback hosting a sleeping environment

Real parts: the transformers engine with the tiny Qwen3, the agent loop, RemoteEnvironment over
real gRPC to a plain EnvironmentServer. The policy is random, so a turn ends at a stop string
(any digit: ~10 tokens) or EOS; the environment answers `episode_turns` turns, then ends the
episode. `latency_overlap_ratio` = tokens_per_s_tool_<delay>ms / tokens_per_s_tool_0ms: 1.0 means
the engine kept decoding other trajectories while some waited on their tool (no slot idles on
I/O); with blocking tool calls it would drop towards turn_time / (turn_time + delay).
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from services.common.tiny import build_tiny_model, build_tokenizer


def _sleeping_environment(delay_s: float, episode_turns: int) -> Any:
    from services.environment.base import (
        CloseResult,
        Environment,
        EnvPrompt,
        Message,
        StartResult,
        StepResult,
        ToolCall,
    )

    class SleepingEnvironment(Environment):
        name = "sleeping"

        async def start(self, session_id: str, prompt: EnvPrompt, *, sample_index: int = 0, policy_version: int = 0) -> StartResult:
            return StartResult()

        async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *,
                       policy_version: int = 0) -> StepResult:
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            return StepResult(messages=(Message("tool", f"result {turn}"),), done=turn + 1 >= episode_turns)

        async def close(self, session_id: str) -> CloseResult:
            return CloseResult()

    return SleepingEnvironment()


async def _run_case(
    tok: Any, model: Any, *, delay_s: float, groups: int, n: int, concurrency: int, slots: int, episode_turns: int,
    max_tokens: int, seed: int,
) -> dict[str, float]:
    from meshrl.v1 import common_pb2
    from services.common.config.environment import EnvironmentConfig, EnvironmentEndpointConfig
    from services.environment.client import RemoteEnvironment
    from services.environment.factory import EnvironmentRouter
    from services.environment.server import EnvironmentServer
    from services.rollout.agent.loop import AgentLoop, AgentSettings
    from services.rollout.engines import SamplingSpec
    from services.rollout.engines.transformers_engine import TransformersEngine

    server = EnvironmentServer(_sleeping_environment(delay_s, episode_turns), EnvironmentConfig(), port=0)
    await server.start()
    remote = RemoteEnvironment(EnvironmentEndpointConfig(address=server.address, name="sleeping", max_concurrent_calls=256))
    engine = TransformersEngine(model, tok, max_num_seqs=slots, max_model_len=512, seed=seed)
    await engine.start()
    agent = AgentLoop(tok, EnvironmentRouter(remote, []), AgentSettings(sanity_mode="disable"))
    sem = asyncio.Semaphore(concurrency)

    async def group(i: int) -> int:
        prompt = common_pb2.Prompt(prompt_seq=max(i, 0), prompt_id=f"bench:{i}")
        prompt.messages.add(role="user", content=f"task {i}: count")
        spec = SamplingSpec(n=n, temperature=1.0, max_tokens=max_tokens, stop=tuple("0123456789"),
                            seed=seed * 100_003 + (i + 2) * n)
        async with sem:
            _, trajectories = await agent.run_group(prompt, spec, f"bench/{delay_s}/{i}", engine.generate, lambda: False,
                                                    lambda: 0)
        return sum(t.policy_tokens for t in trajectories)

    await asyncio.gather(*(group(-1 - k) for k in range(2)))  # warm-up (first forward passes)
    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(group(i) for i in range(groups))))
    dt = time.perf_counter() - t0
    turns = agent.counters.assistant_turns
    env_calls, env_s = agent.counters.env_calls, agent.counters.env_seconds
    await engine.close()
    await agent.aclose()
    await server.stop()
    return {"tokens": float(tokens), "seconds": dt, "tokens_per_s": tokens / dt, "assistant_turns": float(turns),
            "env_calls": float(env_calls), "env_mean_latency_s": env_s / max(1, env_calls)}


def run_benchmark(
    *,
    delay_ms: float = 200.0,
    groups: int = 48,
    n: int = 4,
    concurrency: int = 24,
    slots: int = 64,
    episode_turns: int = 4,
    max_tokens: int = 160,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Interleaved rounds (0 ms, delay, 0 ms, delay, ...; order alternating), medians reported."""
    torch.manual_seed(seed)
    tok = build_tokenizer()
    model = build_tiny_model("qwen3", tok, seed=seed)
    kw: dict[str, Any] = dict(groups=groups, n=n, concurrency=concurrency, slots=slots, episode_turns=episode_turns,
                              max_tokens=max_tokens, seed=seed)
    fast: list[dict[str, float]] = []
    slow: list[dict[str, float]] = []
    for r in range(repeats):
        order = [(0.0, fast), (delay_ms / 1000, slow)]
        for delay_s, out in order if r % 2 == 0 else order[::-1]:
            out.append(asyncio.run(_run_case(tok, model, delay_s=delay_s, **kw)))
    tps0 = statistics.median(c["tokens_per_s"] for c in fast)
    tps1 = statistics.median(c["tokens_per_s"] for c in slow)
    label = f"{delay_ms:g}ms"
    return {
        "benchmark": "agent",
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "workload": {**kw, "delay_ms": delay_ms, "repeats": repeats, "engine": "transformers",
                     "model": "tiny qwen3 (random; turns end at a digit)", "environment": "EnvironmentServer over loopback gRPC"},
        "tokens_per_s_tool_0ms": round(tps0, 1),
        f"tokens_per_s_tool_{label}": round(tps1, 1),
        "latency_overlap_ratio": round(tps1 / tps0, 3),
        "target_ratio": 0.8,
        "runs_tool_0ms": [round(c["tokens_per_s"], 1) for c in fast],
        f"runs_tool_{label}": [round(c["tokens_per_s"], 1) for c in slow],
        "assistant_turns_per_run": statistics.median(c["assistant_turns"] for c in fast),
        f"env_mean_latency_s_{label}": round(statistics.median(c["env_mean_latency_s"] for c in slow), 4),
    }
