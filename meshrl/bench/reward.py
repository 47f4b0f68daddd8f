"""`meshrl bench reward`: samples/s through the reward service, against calling the scorer
function directly in one process (the in-run baseline).

Cases (GSM8K-style items: a ~300-character solution ending in `#### <n>`, two thirds right):
- `direct`: `scorers.gsm8k.compute_score` in a plain loop (baseline);
- `local_pipeline`: LocalScorer, the full pipeline in-process (proto in/out, routing, metrics);
- `local_to_external`: LocalScorer routing the items to the example RewardService
  (examples/reward_server, a subprocess) over loopback gRPC;
- `serve_grpc`: the Ray Serve reward application through Serve's gRPC ingress, built-in scorer;
- `serve_grpc_to_external`: the same application routing to the example service.
Each case runs `concurrency` callers sending `batch_size` items per call for `seconds`.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from meshrl.v1 import reward_pb2 as pb
from services.common.serve_util import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reward_server" / "server.py"
DS = "openai/gsm8k"


def make_items(n: int, seed: int = 0) -> list[pb.ScoreItem]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        answer = a + b if i % 3 else a + b + 1
        text = (
            f"We need to add {a} and {b}. First add the units, then the tens, then the hundreds, carrying "
            f"where needed. {a} + {b} = <<{a}+{b}={answer}>>{answer}. Checking by subtraction: {answer} - {b} "
            f"gives back the first number, so the sum is consistent with the question.\n#### {answer:,}"
        )
        items.append(pb.ScoreItem(item_id=f"q{i}", data_source=DS, response_text=text, ground_truth=str(a + b),
                                  response_token_ids=list(range(len(text) // 4))))
    return items


def bench_direct(items: list[pb.ScoreItem], seconds: float) -> tuple[dict[str, Any], dict[str, float]]:
    """The baseline: the scorer function in a loop. Also returns each item's score."""
    from services.reward.scorers import gsm8k

    expected: dict[str, float] = {}
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for it in items:
            expected[it.item_id] = gsm8k.compute_score(it.data_source, it.response_text, it.ground_truth)["score"]
        n += len(items)
    elapsed = time.perf_counter() - start
    result = {"samples": n, "seconds": round(elapsed, 3), "samples_per_s": round(n / elapsed, 1),
              "mean_score": round(sum(expected.values()) / len(expected), 4)}
    return result, expected


async def _drive(
    call: Callable[[list[pb.ScoreItem]], Awaitable[list[pb.ScoreResult]]],
    items: list[pb.ScoreItem], expected: dict[str, float], *, batch_size: int, concurrency: int, seconds: float,
) -> dict[str, Any]:
    """Drive `call` and check every score against `expected` (the direct function's)."""
    batches = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
    await call(batches[0])  # warm-up: connections, lazy imports
    latencies: list[float] = []
    total = 0
    mismatches = 0
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal total, mismatches
        k = w
        while time.perf_counter() < deadline:
            batch = batches[k % len(batches)]
            k += concurrency
            t0 = time.perf_counter()
            results = await call(batch)
            latencies.append(time.perf_counter() - t0)
            assert [r.item_id for r in results] == [it.item_id for it in batch]
            total += len(results)
            mismatches += sum(r.score != expected[r.item_id] for r in results)

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - start
    lat = sorted(latencies)
    return {
        "samples": total,
        "seconds": round(elapsed, 3),
        "samples_per_s": round(total / elapsed, 1),
        "mismatches": mismatches,
        "call_latency_ms_p50": round(1000 * statistics.median(lat), 2),
        "call_latency_ms_p95": round(1000 * lat[int(0.95 * (len(lat) - 1))], 2),
    }


def _cfg(overrides: list[str]) -> Any:
    from services.common.config import load_config

    return load_config(None, overrides)


def _endpoint_override(address: str) -> str:
    return f"reward.endpoints=[{{address: '{address}', name: example, data_sources: [{DS}], batch_size: 256}}]"


def _start_example() -> tuple[subprocess.Popen[str], str] | None:
    if not EXAMPLE.is_file():
        return None
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--port", str(port)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening" not in line:
        proc.kill()
        raise RuntimeError(f"example reward server did not start: {line!r}")
    return proc, f"127.0.0.1:{port}"


def run_benchmark(
    *, seconds: float = 5.0, batch_size: int = 64, concurrency: int = 4, num_items: int = 1024, serve: bool = True
) -> dict[str, Any]:
    from services.reward.client import RewardClient
    from services.reward.local import LocalScorer

    items = make_items(num_items)
    direct, expected = bench_direct(items, seconds)
    cases: dict[str, Any] = {"direct": direct}
    drive: dict[str, Any] = {"batch_size": batch_size, "concurrency": concurrency, "seconds": seconds}

    async def local(overrides: list[str]) -> dict[str, Any]:
        scorer = LocalScorer(_cfg(overrides))
        try:
            return await _drive(scorer, items, expected, **drive)
        finally:
            await scorer.close()

    cases["local_pipeline"] = asyncio.run(local([]))
    example = _start_example()
    try:
        if example is not None:
            cases["local_to_external"] = asyncio.run(local([_endpoint_override(example[1])]))
        if serve:
            cases.update(_serve_cases(items, expected, drive, example[1] if example else None, RewardClient))
    finally:
        if example is not None:
            example[0].terminate()
            example[0].wait(30)
    base = cases["direct"]["samples_per_s"]
    for name, case in cases.items():
        case["ratio_vs_direct"] = round(case["samples_per_s"] / base, 4)
        if case.get("mismatches"):
            raise AssertionError(f"{name}: {case['mismatches']} scores differ from the direct function's")
    return {
        "benchmark": "reward",
        "machine": f"{os.cpu_count()} CPUs",
        "params": {**drive, "num_items": num_items, "data_source": DS},
        "cases": cases,
    }


def _serve_cases(
    items: list[pb.ScoreItem], expected: dict[str, float], drive: dict[str, Any], external: str | None, client_cls: Any
) -> dict[str, Any]:
    import ray
    from ray import serve

    from services.common.serve_util import APP_LOGGING, init_ray, start_serve
    from services.reward.deployment import build_app

    out: dict[str, Any] = {}
    grpc_port = free_port()
    init_ray()
    try:
        start_serve(grpc_port, http_port=free_port())
        apps: dict[str, list[str]] = {"serve_grpc": []}
        if external is not None:
            apps["serve_grpc_to_external"] = [_endpoint_override(external)]
        for name, overrides in apps.items():
            app = name.replace("_", "-")
            cfg = _cfg(["reward.max_batch_size=16", *overrides])
            serve.run(build_app({"config": cfg.model_dump(mode="json")}), name=app, route_prefix=f"/{app}", logging_config=APP_LOGGING)

            async def go(app: str = app) -> dict[str, Any]:
                async with client_cls(f"127.0.0.1:{grpc_port}", application=app, timeout_s=120) as client:
                    await client.wait_ready(120)
                    return await _drive(client, items, expected, **drive)

            out[name] = asyncio.run(go())
            serve.delete(app)
    finally:
        serve.shutdown()
        ray.shutdown()
    return out
