"""Where the nccl weight transport's time goes, on two GPUs: the transport's steps timed on the
host (each wait, pack, verify and control exchange, summed per kind over the steady rounds) and
one extra round under torch.profiler (kernel time per NCCL op on each side), next to the raw
torch.distributed.broadcast of the same buckets in the same processes. Run on the GPU machine
from the repo root (writes JSON and Chrome traces to $OUT):

    python3 scripts/gpu/weights_trace.py [--size-gb 8] [--bucket-mb 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import pathlib
import queue
import sys
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch

from meshrl.bench import weights as wb
from meshrl.v1 import common_pb2

SPANS: list[tuple[str, float, float]] = []


def _timed(name: str, fn: Any) -> Any:
    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def aw(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                SPANS.append((name, t0, time.perf_counter()))
        return aw

    @functools.wraps(fn)
    def w(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            SPANS.append((name, t0, time.perf_counter()))
    return w


def _patch() -> None:
    from services.weights.client import ParamServerClient
    from services.weights.transports.collective import device, group, receiver, sender

    async def wait(self: Any, work: Any, deadline: Any, doing: str, *rest: Any, _orig: Any = group.Group.wait) -> None:
        t0 = time.perf_counter()
        try:
            await _orig(self, work, deadline, doing, *rest)
        finally:
            key = "wait:" + doing.split(" ")[0] + (" control" if "control" in doing else "")
            SPANS.append((key, t0, time.perf_counter()))

    group.Group.wait = wait  # type: ignore[method-assign]
    for cls, names in ((group.Group, ("broadcast", "allreduce_sum")), (device.Device, ("to_host",)),
                       (sender.CollectivePublisher, ("_pack", "_ensure_group", "_steady_group")),
                       (receiver.CollectiveFetcher, ("_verify", "_ensure_group", "_steady_group"))):
        for n in names:
            if hasattr(cls, n):
                setattr(cls, n, _timed(f"{cls.__name__}.{n}", getattr(cls, n)))
    ParamServerClient.register = _timed("client.register", ParamServerClient.register)  # type: ignore[method-assign]


def _summ(spans: list[tuple[str, float, float]]) -> dict[str, Any]:
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, a, b in spans:
        agg[name][0] += 1
        agg[name][1] += (b - a) * 1e3
    return {k: {"n": int(v[0]), "ms": round(v[1], 3)} for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])}


def _worker(role: str, backend: str, address: str, total: int, bucket: int, rounds: int, barrier: Any, out: Any, raw_port: int,
            outdir: str) -> None:
    _patch()
    local: queue.Queue[Any] = queue.Queue()
    wb._collective_worker(role, backend, address, total, bucket, rounds, barrier, local, raw_port)
    results = local.get()
    per_round: list[dict[str, Any]] = []
    # spans of each steady round: split by the publish/fetch walls recorded in order
    results["host_spans_all_rounds"] = _summ(SPANS)
    # each version's rendezvous alone (the first one forms the group): what the sender waits for
    results["ensure_group_ms"] = [round((b - a) * 1e3, 3) for n, a, b in SPANS if n.endswith("._ensure_group")]
    starts = [a for name, a, _ in SPANS if name.endswith("._steady_group")]
    if starts:  # each round begins by choosing its group: the last steady round alone
        last = [(n, a, b) for n, a, b in SPANS if a >= starts[-1]]
        results["host_spans_last_round"] = _summ(last)
        results["last_round_host_ms"] = round((max(b for _, _, b in last) - starts[-1]) * 1e3, 3)
    SPANS.clear()

    # one extra round under the profiler
    from torch.profiler import ProfilerActivity, profile

    from services.weights.transports.collective import CollectiveFetcher, CollectivePublisher

    dev = "cuda" if backend == "nccl" else "cpu"
    weights = wb.make_weights(total, bucket, dev) if role == "sender" else None

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])

    async def one() -> float:
        if role == "sender":
            pub = CollectivePublisher(backend, address, receivers=1, group="trace", timeout_s=600)
            await asyncio.to_thread(barrier.wait)  # the event loop keeps running (background RPCs)
            await pub.publish(100, weights or [])  # warm: group formed
            sync()
            await asyncio.to_thread(barrier.wait)  # the event loop keeps running (background RPCs)
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                await pub.publish(101, weights or [])
                sync()
                dt = time.perf_counter() - t0
            await pub.close()
        else:
            f = CollectiveFetcher(backend, address, consumer_id="trace-1", group="trace", timeout_s=600)
            await asyncio.to_thread(barrier.wait)  # the event loop keeps running (background RPCs)
            await wb._drain(f.fetch(common_pb2.WeightsRef(policy_version=100)))
            sync()
            await asyncio.to_thread(barrier.wait)  # the event loop keeps running (background RPCs)
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                await wb._drain(f.fetch(common_pb2.WeightsRef(policy_version=101)))
                sync()
                dt = time.perf_counter() - t0
            await f.close()
        prof.export_chrome_trace(os.path.join(outdir, f"trace_{role}.json"))
        kern = []
        for e in prof.key_averages():
            dev_us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
            if dev_us:
                kern.append({"name": e.key[:90], "count": e.count, "device_ms": round(dev_us / 1e3, 3),
                             "cpu_ms": round(e.cpu_time_total / 1e3, 3)})
        kern.sort(key=lambda k: -k["device_ms"])
        results["profiled_round"] = {"wall_ms": round(dt * 1e3, 3), "kernels": kern[:25],
                                     "host_spans": _summ(SPANS)}
        return dt

    asyncio.run(one())
    results["per_round"] = per_round
    out.put(results)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=8)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="nccl")
    args = ap.parse_args()
    outdir = os.environ.get("OUT", "/tmp/meshrl-gpu-out")
    os.makedirs(outdir, exist_ok=True)
    total, bucket = int(args.size_gb * wb.GiB), args.bucket_mb * wb.MiB

    got = wb.run_collective_pair(args.backend, total, bucket, args.rounds, worker=_worker, extra=(outdir,))
    gb = total / 1e9
    summary: dict[str, Any] = {"size_gb": args.size_gb, "bucket_mb": args.bucket_mb, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for role, r in got.items():
        summary[role] = {
            "transport_GBps": [round(gb / x, 1) for x in r["transport"]],
            "raw_bucketed_GBps": [round(gb / x, 1) for x in r.get("raw_bucketed", [])],
            "raw_whole_GBps": [round(gb / x, 1) for x in r.get("raw_whole", [])],
            "host_spans_all_rounds": r["host_spans_all_rounds"],
            "host_spans_last_round": r.get("host_spans_last_round"),
            "last_round_host_ms": r.get("last_round_host_ms"),
            "ensure_group_ms": r.get("ensure_group_ms"),
            "profiled_round": r["profiled_round"],
        }
    text = json.dumps(summary, indent=1)
    pathlib.Path(outdir, f"weights_trace_{args.bucket_mb}.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
