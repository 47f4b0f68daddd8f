"""`meshrl bench weights-delta`: delta sync (`param_server.delta_sync`) against whole versions, over
the collective transport (nccl on GPU 0 -> GPU 1; gloo on CPU as a functional check), the same
versions in the same two processes and the same run.

The versions come from an optimizer-like walk, so the share of bf16 elements that change is what
a run's learning rate makes it, not a number the bench picks: fp32 master weights w ~ N(0, 0.02),
each version w -= lr * sign(noise) (Adam's step is ~lr per element), and the version is w in bf16.
At |w| ~ 0.02 one bf16 unit in the last place is ~1.2e-4, so lr = 1e-6 moves ~1% of the elements
by a unit per version and lr = 1e-5 ~10%.

Cases, per lr: `whole` (delta_sync off) and `delta` (on; its first version goes whole, the
following ones as deltas). Each round is timed from a barrier until both sides are done (the
sender's publish includes computing the delta, the receiver's fetch rebuilding and checking every
tensor). The receiver checks the last version it rebuilt against the same walk computed locally.
"""

from __future__ import annotations

import asyncio
import platform
import time
from typing import Any

import torch

import services.common.config  # noqa: F401  (config tree first)
from meshrl.v1 import common_pb2

from .weights import GiB, MiB, _drain, _summary, run_collective_pair

TENSOR_BYTES = 64 * MiB
"""bf16 bytes per tensor of the walk (a 7B model's large matrices are 50-260 MiB)."""


class _Walk:
    """fp32 master weights on `device` and their bf16 versions: the same sequence on every process."""

    def __init__(self, total: int, device: str, lr: float, seed: int) -> None:
        self.lr = lr
        self.seed = seed
        self.device = device
        sizes = [TENSOR_BYTES // 2] * (total // TENSOR_BYTES) + ([total % TENSOR_BYTES // 2] if total % TENSOR_BYTES else [])
        g = torch.Generator(device=device).manual_seed(seed)
        self.master = [torch.randn(n, generator=g, device=device) * 0.02 for n in sizes if n]
        self.version = 0

    def step(self) -> None:
        self.version += 1
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + self.version)
        for w in self.master:
            w.sub_(torch.randn(w.shape, generator=g, device=self.device).sign_().mul_(self.lr))

    def buckets(self, bucket: int) -> list[list[tuple[str, torch.Tensor]]]:
        out: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for i, w in enumerate(self.master):
            t = w.to(torch.bfloat16)
            if out[-1] and size + t.numel() * 2 > bucket:
                out.append([])
                size = 0
            out[-1].append((f"model.layers.{i}.weight", t))
            size += t.numel() * 2
        return out


def _worker(role: str, backend: str, address: str, total: int, bucket: int, rounds: int, barrier: Any, out: Any,
            raw_port: int, lrs: tuple[float, ...]) -> None:
    from services.weights.transports.collective import CollectiveFetcher, CollectivePublisher

    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(0 if role == "sender" else 1)
        device = "cuda"

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    async def case(lr: float, delta: bool, group: str) -> dict[str, Any]:
        times, stats = [], []
        walk = _Walk(total, device, lr, seed=1)
        if role == "sender":
            pub = CollectivePublisher(backend, address, receivers=1, group=group, timeout_s=600, delta_sync=delta)
            for v in range(1, rounds + 2):
                walk.step()
                buckets = walk.buckets(bucket)
                sync()
                await asyncio.to_thread(barrier.wait)
                t0 = time.perf_counter()
                await pub.publish(v, buckets)
                sync()
                times.append(time.perf_counter() - t0)
                if pub.delta is not None:
                    stats.append(pub.delta.last.as_dict())
                del buckets
                await pub.settle()
            await pub.close()
            return {"times": times, "stats": stats}
        fetcher = CollectiveFetcher(backend, address, consumer_id="bench-rank-1", group=group, timeout_s=600,
                                    delta_sync=delta)
        last: dict[str, torch.Tensor] = {}
        for v in range(1, rounds + 2):
            await asyncio.to_thread(barrier.wait)
            t0 = time.perf_counter()
            got = await _drain(fetcher.fetch(common_pb2.WeightsRef(policy_version=v)), last if v == rounds + 1 else None)
            sync()
            times.append(time.perf_counter() - t0)
            assert got == total, f"received {got} of {total} bytes"
        await fetcher.close()
        for _ in range(rounds + 1):
            walk.step()
        want = dict(walk.buckets(total)[0]) if walk.master else {}
        same = set(want) == set(last) and all(torch.equal(last[n], t) for n, t in want.items())
        return {"times": times, "identical": same}

    async def main() -> dict[str, Any]:
        cases: dict[str, Any] = {}
        for i, lr in enumerate(lrs):
            for mode in ("whole", "delta"):
                cases[f"{mode}@lr={lr:g}"] = await case(lr, mode == "delta", f"bench-{i}-{mode}")
                if device == "cuda":
                    torch.cuda.empty_cache()
        return cases

    out.put({"role": role, "cases": asyncio.run(main())})


def run_benchmark(*, size_gb: float = 4.0, bucket_mb: int = 512, rounds: int = 5, lrs: tuple[float, ...] = (1e-6, 1e-5),
                  backend: str = "nccl") -> dict[str, Any]:
    total = int(size_gb * GiB) // 2 * 2
    bucket = bucket_mb * MiB
    if backend == "nccl" and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs (a sender and a receiver), found {torch.cuda.device_count()}")
    got = run_collective_pair(backend, total, bucket, rounds, worker=_worker, extra=(lrs,))
    result: dict[str, Any] = {
        "benchmark": "weights_delta", "bytes": total, "bucket_bytes": bucket, "rounds": rounds, "backend": backend,
        "tensor_bytes": TENSOR_BYTES,
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "gpus": [torch.cuda.get_device_name(i) for i in range(2)] if backend == "nccl" else []},
        "cases": {}, "ratios": {},
    }
    for name, sent in got["sender"]["cases"].items():
        recv = got["receiver"]["cases"][name]
        per_round = [{"sync": max(a, b)} for a, b in zip(sent["times"], recv["times"], strict=True)]
        summary = _summary(total, per_round)["sync"]  # the first round (cold, and whole in `delta`) apart
        entry: dict[str, Any] = {"sync": summary, "identical": recv["identical"]}
        if sent["stats"]:
            steady = sent["stats"][1:]
            entry["first_version"] = sent["stats"][0]
            entry["sent_fraction"] = [round(s["sent_fraction"], 5) for s in steady]
            entry["changed_fraction"] = [round(s["changed_fraction"], 5) for s in steady]
            entry["sent_bytes_median"] = sorted(s["sent_bytes"] for s in steady)[len(steady) // 2]
        result["cases"][name] = entry
    for name, entry in result["cases"].items():
        if name.startswith("delta@"):
            whole = result["cases"]["whole@" + name.split("@", 1)[1]]["sync"]
            result["ratios"][name.split("@", 1)[1]] = {
                "time_delta_over_whole_median": round(entry["sync"]["median_s"] / whole["median_s"], 4),
                "time_delta_over_whole_best": round(entry["sync"]["best_s"] / whole["best_s"], 4),
                "bytes_delta_over_whole_median": round(entry["sent_bytes_median"] / total, 5),
            }
    return result
