"""`meshrl bench coordinator`: groups/s and lease latency through the real gRPC path.

For each server kind (plain grpc.aio; Ray Serve's gRPC ingress) it measures, in one run:
  echo      Echo RPCs carrying the bytes of one submitted group: the transport baseline
  lease     LeasePrompts(max_groups=1) latency p50/p99
  submit    SubmitGroups of one group: latency p50/p99, compared with echo of the same bytes
  cycle     lease -> submit -> fetch, unbatched (1 group per call) and batched (64 per call),
            with 4 concurrent rollout clients: groups/s end to end
Ratios are against the echo baseline measured in the same run on the same server.
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import tempfile
import time
from typing import Any

from meshrl.v1 import common_pb2, coordinator_pb2
from services.common.config import load_config
from services.common.serve_util import free_port
from services.coordinator.client import CoordinatorClient

N_RESPONSES = 4
TOKENS = 64
PROMPT_TOKENS = 16
BATCH = 64
CLIENTS = 4


def _template() -> common_pb2.TrajectoryGroup:
    g = common_pb2.TrajectoryGroup()
    g.prompt_token_ids.extend(range(PROMPT_TOKENS))  # the coordinator refuses a group without them
    for i in range(N_RESPONSES):
        g.responses.add(sample_index=i, token_ids=list(range(TOKENS)), logprobs=[-0.5] * TOKENS, versions=[0] * TOKENS,
                        reward=1.0, text="x" * TOKENS)
    return g


_TEMPLATE = _template()


def _group(lease: coordinator_pb2.PromptLease) -> common_pb2.TrajectoryGroup:
    """A group answering `lease` (the responses are a fixed template: the client's cost is not
    what this benchmark measures)."""
    g = common_pb2.TrajectoryGroup()
    g.CopyFrom(_TEMPLATE)
    g.lease_id = lease.lease_id
    g.prompt.CopyFrom(lease.prompt)
    return g


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000.0


async def _timed(fn: Any, seconds: float, min_calls: int = 20) -> list[float]:
    lat: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(lat) < min_calls:
        t0 = time.perf_counter()
        await fn()
        lat.append(time.perf_counter() - t0)
    return lat


def _lat(lat: list[float]) -> dict[str, float]:
    return {"calls": len(lat), "p50_ms": round(_pct(lat, 0.5), 3), "p99_ms": round(_pct(lat, 0.99), 3),
            "mean_ms": round(statistics.fmean(lat) * 1000, 3), "calls_per_s": round(len(lat) / sum(lat), 1)}


async def _cycle(c: CoordinatorClient, batch: int, seconds: float) -> dict[str, float]:
    """CLIENTS rollout loops lease+submit `batch` groups per call; one trainer loop fetches."""
    done = 0
    stop = time.monotonic() + seconds

    async def rollout(k: int) -> None:
        while time.monotonic() < stop:
            grant = await c.lease(f"bench-r{k}", batch)
            if grant.leases:
                await c.submit(f"bench-r{k}", [_group(lease) for lease in grant.leases])
            elif grant.limit != coordinator_pb2.LEASE_LIMIT_NONE:
                raise RuntimeError(f"the bench's run stopped granting leases ({grant.limit}): the numbers would be wrong")
            else:
                await asyncio.sleep(0.001)

    async def trainer() -> None:
        nonlocal done
        step = 0
        while time.monotonic() < stop:
            step += 1
            b = await c.fetch_batch("bench-t", step, batch, timeout_ms=200)
            done += len(b.groups)

    t0 = time.monotonic()
    await asyncio.gather(trainer(), *[rollout(k) for k in range(CLIENTS)])
    wall = time.monotonic() - t0
    return {"groups": done, "seconds": round(wall, 3), "groups_per_s": round(done / wall, 1)}


async def _measure(address: str, application: str | None, seconds: float) -> dict[str, Any]:
    async with CoordinatorClient(address, application=application, timeout_s=60) as c:
        await c.wait_ready(60)
        (lease,) = (await c.lease("bench-probe", 1)).leases
        payload = _group(lease).SerializeToString()
        for _ in range(20):  # warm-up
            await c.echo(payload)
        echo = await _timed(lambda: c.echo(payload), seconds)
        lease_lat = await _timed(lambda: c.lease("bench-lat", 1), seconds / 2)

        async def one_submit() -> None:
            (ls,) = (await c.lease("bench-sub", 1)).leases
            t0 = time.perf_counter()
            await c.submit("bench-sub", [_group(ls)])
            sub_lat.append(time.perf_counter() - t0)

        sub_lat: list[float] = []
        await _timed(one_submit, seconds / 2)
        drained = 0

        async def drain() -> None:
            # what the probes (or the previous cycle) queued, so each cycle starts empty: a cycle's
            # groups/s counts only groups leased and submitted in its own window
            nonlocal drained
            while (await c.status()).totals.queued:
                drained += 1
                await c.fetch_batch("bench-drain", drained, 4096, timeout_ms=0)

        await drain()
        unbatched = await _cycle(c, 1, seconds)
        await drain()
        batched = await _cycle(c, BATCH, seconds)
    echo_s, sub_s = _lat(echo), _lat(sub_lat)
    return {
        "payload_bytes": len(payload),
        "echo": echo_s,
        "lease": _lat(lease_lat),
        "submit_1_group": sub_s,
        "submit_over_echo_p50": round(sub_s["p50_ms"] / echo_s["p50_ms"], 3),
        "lease_over_echo_p50": round(_lat(lease_lat)["p50_ms"] / echo_s["p50_ms"], 3),
        "cycle_unbatched": unbatched,
        "cycle_batched": batched,
    }


def _bench_overrides(run_dir: str, port: int) -> dict[str, Any]:
    # A budget that never binds: this measures the service, not the staleness policy.
    return {
        "coordinator.port": port, "actor_rollout_ref.actor.ppo_mini_batch_size": 1024,
        "async_training.staleness_threshold": 1000, "async_training.trigger_parameter_sync_step": 1,
        "rollout.total_rollout_steps": 100_000_000, "actor_rollout_ref.rollout.n": N_RESPONSES,
        # 1000 prompts x 1,000,000 epochs: the data never runs out within a measurement (with the
        # default 10 epochs it did after 10,000 groups, and the rest of the window counted as idle).
        "data.synthetic.num_train": 1000, "rollout.total_epochs": 1_000_000,
        "coordinator.ledger_path": f"{run_dir}/ledger.sqlite",
    }


def _bench_config(run_dir: str, port: int) -> Any:
    return load_config(None, [f"{k}={v}" for k, v in _bench_overrides(run_dir, port).items()])


def _plain(seconds: float) -> dict[str, Any]:
    """The coordinator in its own process (`meshrl coordinator serve`), as deployed without Ray."""
    import os
    import subprocess
    import sys

    from services.common.serve_util import repo_root

    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        overrides = [f"{k}={v}" for k, v in _bench_overrides(d, port).items()]
        env = {**os.environ, "PYTHONPATH": str(repo_root()), "MESHRL_LOG_LEVEL": "WARNING"}
        proc = subprocess.Popen([sys.executable, "-m", "meshrl.cli", "coordinator", "serve", *overrides, "--run-dir", d],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            return asyncio.run(_measure(f"127.0.0.1:{port}", None, seconds))
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _serve(seconds: float) -> dict[str, Any]:
    import ray
    from ray import serve

    from services.common.serve_util import APP_LOGGING, init_ray, start_serve
    from services.coordinator.deployment import build_app

    port, http = free_port(), free_port()
    init_ray(num_cpus=4)
    start_serve(port, http_port=http)
    try:
        with tempfile.TemporaryDirectory() as d:
            cfg = _bench_config(d, 0)
            serve.run(build_app({"config": cfg.model_dump(mode="json"), "run_dir": d}), name="coordinator",
                      route_prefix="/coordinator", logging_config=APP_LOGGING)
            return asyncio.run(_measure(f"127.0.0.1:{port}", "coordinator", seconds))
    finally:
        serve.shutdown()
        ray.shutdown()


def run_benchmark(seconds: float = 5.0, serve: bool = True) -> dict[str, Any]:
    import os

    result: dict[str, Any] = {
        "benchmark": "coordinator",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}",
        "groups": f"{N_RESPONSES} responses x {TOKENS} tokens",
        "batched_groups_per_call": BATCH,
        "concurrent_rollout_clients": CLIENTS,
        "plain_grpc_aio": _plain(seconds),
    }
    if serve:
        result["serve_ingress"] = _serve(seconds)
    return result
