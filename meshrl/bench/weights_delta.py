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

`--cross-node` (gloo): the sender on node c, the receiver on node b and their param server on node
a of three network namespaces (meshrl/netns_cluster.py): the group forms on the address the sender
reaches the param server from, and every byte crosses two veths and the bridge, as between hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import platform
import queue
import shutil
import time
from typing import Any

import torch

import services.common.config  # noqa: F401  (config tree first)
from meshrl.v1 import common_pb2
from services.common.net import source_address

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

    # the address the receiver dials for the group (its store): the one this process reaches the
    # param server from, on the network every member shares (loopback when all run on one host)
    master = source_address(address.rsplit(":", 1)[0]) or "127.0.0.1"

    async def case(lr: float, delta: bool, group: str) -> dict[str, Any]:
        times, stats = [], []
        walk = _Walk(total, device, lr, seed=1)
        if role == "sender":
            pub = CollectivePublisher(backend, address, receivers=1, group=group, timeout_s=600, delta_sync=delta,
                                      master_address=master)
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

    out.put({"role": role, "cases": asyncio.run(main()), "master_address": master})


def _param_server(host: str, out: Any, stop: Any) -> None:
    """A param server on `host` (its rendezvous), until `stop` is set; puts its address on `out`."""
    from services.common.config.param_server import ParamServerConfig
    from services.param_server.server import ParamServerServer

    async def main() -> None:
        server = ParamServerServer(ParamServerConfig(host=host, port=0, retain_versions=1))
        await server.start()
        out.put({"role": "server", "address": server.address})
        while not stop.is_set():
            await asyncio.sleep(0.2)
        await server.stop()

    asyncio.run(main())


def run_pair_across_nodes(cluster: Any, backend: str, total: int, bucket: int, rounds: int,
                          extra: tuple[Any, ...]) -> dict[str, Any]:
    """`_worker`'s sender on node c and receiver on node b of `cluster` (a NetnsCluster: processes
    entered into its namespaces, no Ray), their param server on node a: the group's traffic
    crosses the veths and the bridge, as between hosts. Returns what each role put on the queue."""
    from meshrl.netns_cluster import run_in_netns

    ctx = mp.get_context("spawn")
    out, barrier, stop = ctx.Queue(), ctx.Barrier(2), ctx.Event()
    node = {"server": "a", "sender": "c", "receiver": "b"}
    server = ctx.Process(target=run_in_netns, args=(cluster.nodes["a"].netns, _param_server, cluster.ip("a"), out, stop),
                         daemon=True)
    server.start()
    procs: list[Any] = []
    try:
        first = out.get(timeout=120)
        if first.get("role") != "server":
            raise RuntimeError(f"expected the param server's address first, got {first}")
        address = first["address"]
        procs = [ctx.Process(target=run_in_netns,
                             args=(cluster.nodes[node[role]].netns, _worker, role, backend, address, total, bucket,
                                   rounds, barrier, out, 0, *extra), daemon=True)
                 for role in ("sender", "receiver")]
        for p in procs:
            p.start()
        got: dict[str, Any] = {"server": first}
        while len(got) < 3:
            try:
                r = out.get(timeout=1.0)
                got[r["role"]] = r
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a {backend} worker failed: exit codes {[p.exitcode for p in procs]}") from None
        return got
    finally:
        stop.set()
        for p in [*procs, server]:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def run_benchmark(*, size_gb: float = 4.0, bucket_mb: int = 512, rounds: int = 5, lrs: tuple[float, ...] = (1e-6, 1e-5),
                  backend: str = "nccl", cross_node: bool = False, cluster: Any = None) -> dict[str, Any]:
    """`cross_node` (gloo only): the sender, the receiver and the param server on three nodes of
    network namespaces (`cluster`, or one made for the run and removed after it: root, iproute2)."""
    total = int(size_gb * GiB) // 2 * 2
    bucket = bucket_mb * MiB
    if cross_node or cluster is not None:
        if backend != "gloo":
            raise SystemExit("--cross-node runs on CPUs: use --backend gloo")
        with contextlib.ExitStack() as stack:
            if cluster is None:
                import tempfile
                from pathlib import Path

                from meshrl.netns_cluster import netns_cluster

                work = Path(tempfile.mkdtemp(prefix="meshrl-delta-crossnode-"))
                stack.callback(shutil.rmtree, work, True)
                cluster = stack.enter_context(netns_cluster(("a", "b", "c"), work_dir=work, num_cpus=1,
                                                            object_store_mb=128, dashboard=False))
            got = run_pair_across_nodes(cluster, backend, total, bucket, rounds, extra=(lrs,))
        placement = {"param_server": got["server"]["address"], "sender_master": got["sender"]["master_address"],
                     "link": "veth pairs on a Linux bridge, one network namespace per node, one machine"}
    else:
        if backend == "nccl" and torch.cuda.device_count() < 2:
            raise SystemExit(f"needs 2 GPUs (a sender and a receiver), found {torch.cuda.device_count()}")
        got = run_collective_pair(backend, total, bucket, rounds, worker=_worker, extra=(lrs,))
        placement = {"where": "two processes of this host"}
    result: dict[str, Any] = {
        "benchmark": "weights_delta", "bytes": total, "bucket_bytes": bucket, "rounds": rounds, "backend": backend,
        "tensor_bytes": TENSOR_BYTES, "placement": placement,
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
