"""`meshrl bench weights`, the export's side: what packing costs the export (with the fingerprint
it takes as it goes, against the same copies alone), and a version crossing from a trainer rank
(a Ray actor) to its deployment, as `RayTrainGroup.export_weights` receives it: the wire form
against torch's pickling and ray.put + ray.get, and through the object_store publisher registered
as it crossed against put again. Called by meshrl/bench/weights.py (`--hop`, `--source-device`)."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import torch

from .weights import _drain, _gbps, make_weights


async def from_rank(directory: Any, fetcher: Any, nbytes: int, bucket: int, rounds: int,
                     warmup: int) -> dict[str, list[dict[str, float]]]:
    """Rounds of a version streamed from a rank actor on this node, published and fetched:
    `registered` (each bucket's object registered as it crossed) and `put_again` alternated."""
    from services.weights.packing import from_wire
    from services.weights.transports.object_store import ObjectStorePublisher

    rank = _hop_rank(nbytes, bucket)
    await rank.__ray_ready__.remote()
    pub = ObjectStorePublisher(directory)

    async def exported(keep: bool) -> Any:
        async for ref in rank.export.options(num_returns="streaming").remote("wire"):
            yield from_wire(await ref, stored=ref if keep else None)

    out: dict[str, list[dict[str, float]]] = {"registered": [], "put_again": []}
    version = 1_000_000  # above the plain rounds' versions: retention keeps the newest
    for _ in range(1 + warmup + rounds):
        for key, keep in (("registered", True), ("put_again", False)):
            version += 1
            t0 = time.perf_counter()
            ref = await pub.publish(version, exported(keep))
            t1 = time.perf_counter()
            got = await _drain(fetcher.fetch(ref))
            t2 = time.perf_counter()
            assert got == nbytes, f"{key}: fetched {got} of {nbytes} bytes"
            out[key].append({"publish": t1 - t0, "fetch": t2 - t1, "end_to_end": t2 - t0})
    await pub.close()
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_export(total: int, bucket: int, device: str = "cpu", repeats: int = 5) -> dict[str, Any]:
    """What the export's packing costs for these bytes: each bucket's tensors, on `device` (as an
    engine's gathered parameters), copied into a new host buffer per bucket. `pack_stream` (the FSDP
    export: it fingerprints as it copies) against the same copies alone (`pack_into`, into new
    buffers as well: both pay the same page faults), alternated, best of `repeats`.
    `fingerprint_s` is what the fingerprint adds to the export: the price of the publish-side pass
    the packed buckets spare the host transports."""
    from services.weights.layout import pack_into, plan_bucket
    from services.weights.packing import pack_bucket

    source = make_weights(total, bucket, device=device, layout="tensors", seed=1)
    plans = [plan_bucket(0, b) for b in source]
    packs, copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out: list[Any] = [pack_bucket(b) for b in source]
        _sync(device)
        packs.append(time.perf_counter() - t0)
        del out
        t0 = time.perf_counter()
        out = []
        for b, (metas, nbytes) in zip(source, plans, strict=True):
            buf = torch.empty(nbytes, dtype=torch.uint8)
            pack_into(buf, b, metas)
            out.append(buf)
        _sync(device)
        copies.append(time.perf_counter() - t0)
        del out
    best_pack, best_copy = min(packs), min(copies)
    result = {"source_device": device, "pack_best_s": round(best_pack, 4), "copy_best_s": round(best_copy, 4),
              "pack_s": [round(x, 4) for x in packs], "copy_s": [round(x, 4) for x in copies],
              "fingerprint_s": round(max(0.0, best_pack - best_copy), 4)}
    if device.startswith("cuda"):  # the pinned stage against the direct copy into pageable memory
        direct = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = [pack_bucket(b, staged=False) for b in source]
            _sync(device)
            direct.append(time.perf_counter() - t0)
            del out
        result |= {"pack_direct_best_s": round(min(direct), 4), "pack_direct_s": [round(x, 4) for x in direct],
                   "staging_speedup_best": round(min(direct) / best_pack, 2),
                   # what the fingerprint adds to the direct copies: the same copies, one more reduction
                   "fingerprint_direct_s": round(max(0.0, min(direct) - best_copy), 4)}
    return result


class _HopRank:
    """A trainer rank's side of the hop (a Ray actor): the packed buckets an export yields."""

    def __init__(self, total: int, bucket: int) -> None:
        self.buckets: list[Any] = make_weights(total, bucket, layout="packed", seed=2)

    def export(self, form: str) -> Any:
        from services.weights.packing import to_wire

        for b in self.buckets:
            # wire: what a rank yields (packing.WireBucket); torch: the bucket's buffer as a torch
            # tensor, as the wire form carried it before (torch's own pickling)
            yield to_wire(b) if form == "wire" else b.buffer

    def put(self) -> list[Any]:
        import ray

        return [ray.put(b.buffer.numpy()) for b in self.buckets]


def _hop_rank(total: int, bucket: int) -> Any:
    import ray

    rank: Any = ray.remote(num_cpus=0)(_HopRank)
    return rank.remote(total, bucket)


def bench_hop(total: int, bucket: int, rounds: int = 3) -> dict[str, Any]:
    """A version's packed buckets crossing from a trainer rank (a Ray actor) to its deployment
    (this process), as `RayTrainGroup.export_weights` receives them: the wire form (packing.py)
    against the buffer as a torch tensor (torch's own pickling, the wire form before) and against a
    physical baseline, ray.put of the same bytes in the rank and ray.get here (one copy into shared
    memory, a zero-copy read). Alternated per round; best and median seconds per version."""
    import ray

    from services.common.serve_util import init_ray
    from services.weights.packing import from_wire

    started = not ray.is_initialized()
    init_ray(num_cpus=4)
    try:
        rank = _hop_rank(total, bucket)
        ray.get(rank.__ray_ready__.remote())

        async def stream(form: str) -> float:
            t0 = time.perf_counter()
            got = 0
            async for ref in rank.export.options(num_returns="streaming").remote(form):
                item = await ref
                got += sum(t.nbytes for _, t in from_wire(item)) if form == "wire" else item.nbytes
                del item
            assert got == total, f"{form}: {got} of {total} bytes"
            return time.perf_counter() - t0

        async def put_get() -> float:
            t0 = time.perf_counter()
            refs = await rank.put.remote()
            got = sum(a.nbytes for a in await asyncio.gather(*refs))
            assert got == total
            return time.perf_counter() - t0

        async def main() -> dict[str, list[float]]:
            times: dict[str, list[float]] = {"wire": [], "torch_pickle": [], "put_get": []}
            for _ in range(1 + rounds):  # round 0 warms the store up: not counted
                times["wire"].append(await stream("wire"))
                times["torch_pickle"].append(await stream("torch"))
                times["put_get"].append(await put_get())
            return {k: v[1:] for k, v in times.items()}

        times = asyncio.run(main())
    finally:
        if started:
            ray.shutdown()
    out: dict[str, Any] = {"where": "trainer rank (Ray actor) -> this process, as RayTrainGroup.export_weights"}
    for key, xs in times.items():
        out[key] = {"best_s": round(min(xs), 4), "median_s": round(statistics.median(xs), 4),
                    "best_GBps": _gbps(total, min(xs)), "s": [round(x, 4) for x in xs]}
    # the wire form against torch's pickling (> 1: the wire form took less) and against put/get (<= 1)
    out["wire_speedup_vs_torch_pickle"] = round(min(times["torch_pickle"]) / min(times["wire"]), 2)
    out["wire_vs_put_get"] = round(min(times["put_get"]) / min(times["wire"]), 3)
    return out
