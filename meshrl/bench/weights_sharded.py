"""`meshrl bench weights-sharded`: weight sync from trainer rank 0 against sync from every trainer
rank (`param_server.collective_sharded`), S trainer ranks -> R rollout ranks, the same bytes
(every rollout rank ends with every whole tensor), in the same processes and the same run.

Processes: S senders (trainer ranks, GPU 0..S-1), R receivers (rollout ranks, GPU S..S+R-1), a
param server in this process. Each sender holds the rows of every tensor that FSDP would give it
(torch.chunk along dim 0); rank 0 also holds the whole tensors, for the rank-0 cases (in a run,
rank 0 first all-gathers them: `gather` times that all-gather on the sender ranks, separately).

Cases, each timed from a barrier of all processes until the last receiver has every byte:
  raw_rank0      torch.distributed broadcast of the whole payload from rank 0 (bucket by bucket)
  raw_sharded    each sender broadcasts its rows in a group of its own, all at once
  rank0          the collective transport: CollectivePublisher on rank 0, CollectiveFetcher
  sharded        one CollectivePublisher per sender, ShardedFetcher on each receiver (rebuilds
                 whole tensors)
  gather         the all-gather of the rows over the sender ranks (what rank 0's export costs)

`--cross-node` (gloo): each rank on a node of its own (a network namespace, meshrl/netns_cluster.py,
no Ray), trainer ranks t0..t{S-1}, rollout ranks r0..r{R-1}, the param server in this process on
the bridge. `--link-mbit X` gives every node a link of X Mbit/s each way (a NIC on a non-blocking
switch): the wire sets the pace, not this machine's CPUs. A receiver must take in the whole
version through its own link however many ranks send, so the time per version falls with S while
the senders' links are the limit, and stops falling once the receivers' links are. (gloo's
broadcast is a binomial tree whose root sends to ceil(log2(R + 1)) peers at once, so rank 0's link
carries that many copies; nccl's ring carries one per link, which this does not model.)
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import platform
import queue
import socket
import time
from typing import Any

import torch

import services.common.config  # noqa: F401  (config tree first)
from meshrl.v1 import common_pb2

from .weights import GiB, MiB, _drain, _summary, make_weights


def _rows(rows: int, rank: int, senders: int) -> tuple[int, int]:
    chunk = -(-rows // senders)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def _worker(rank: int, senders: int, receivers: int, address: str, total: int, bucket: int, rounds: int,
            barrier: Any, out: Any, master: str, port: int, backend: str) -> None:
    import torch.distributed as dist

    from services.common.net import gloo_interface, source_address
    from services.weights.shards import sender_group, shard_name
    from services.weights.transports.collective import CollectiveFetcher, CollectivePublisher, ShardedFetcher

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    gpu = backend == "nccl"
    if gpu:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
    world = senders + receivers
    is_sender = rank < senders
    if backend == "gloo" and (ifname := gloo_interface(master)):
        os.environ["GLOO_SOCKET_IFNAME"] = ifname  # the interface toward rank 0 (another node's, cross-node)
    dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                            device_id=dev if gpu else None)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    recv_ranks = list(range(senders, world))
    groups = [dist.new_group([s, *recv_ranks]) for s in range(senders)]
    sender_pg = dist.new_group(list(range(senders)))
    full = make_weights(total, bucket, dev.type, seed=1) if rank == 0 else None
    mine: list[list[tuple[str, torch.Tensor]]] = []
    if is_sender:
        src = full if full is not None else make_weights(total, bucket, dev.type, seed=1)
        for b in src:
            part = []
            for name, t in b:
                a, z = _rows(t.shape[0], rank, senders)
                if z > a:
                    part.append((shard_name(name, a, z, t.shape[0]), t[a:z].clone()))
            mine.append(part)
        if rank != 0:
            del src
    res: dict[str, Any] = {"rank": rank}
    here = source_address(address.rsplit(":", 1)[0]) or "127.0.0.1"  # where receivers dial this sender's group

    def timed(key: str, fn: Any) -> None:
        times = []
        for _ in range(rounds + 1):
            barrier.wait()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        res[key] = times

    # raw baselines: the same buckets as flat bytes
    shard_sizes = [[sum(b) for b in _shard_plan(total, bucket, s, senders)] for s in range(senders)]
    if full is not None:
        flat_full = [torch.cat([t.reshape(-1).view(torch.uint8) for _, t in b]) for b in full]
    elif not is_sender:
        flat_full = [torch.empty(n, dtype=torch.uint8, device=dev) for n in _bucket_sizes(total, bucket)]
    else:
        flat_full = []
    flat_mine = [torch.cat([t.reshape(-1).view(torch.uint8) for _, t in b]) for b in mine]
    recv_shards = [[torch.empty(n, dtype=torch.uint8, device=dev) for n in shard_sizes[s]] for s in range(senders)]

    def raw_rank0() -> None:
        if rank == 0 or not is_sender:
            for t in flat_full:
                dist.broadcast(t, src=0, group=groups[0])

    def raw_sharded() -> None:
        works = []
        for s in range(senders):
            if is_sender and s != rank:
                continue
            bufs = flat_mine if rank == s else recv_shards[s]
            works += [dist.broadcast(t, src=s, group=groups[s], async_op=True) for t in bufs]
        for w in works:
            w.wait()

    timed("raw_rank0", raw_rank0)
    timed("raw_sharded", raw_sharded)
    if is_sender:
        assert all(len(set(sz)) == 1 for sz in zip(*shard_sizes, strict=True)), "the bench splits buckets evenly"
        gathered = [torch.empty(n * senders, dtype=torch.uint8, device=dev) for n in shard_sizes[0]]
        times = []
        for _ in range(rounds + 1):  # the rows of every rank to every rank: what FSDP's unshard moves
            dist.barrier(group=sender_pg)
            sync()
            t0 = time.perf_counter()
            for i, t in enumerate(flat_mine):
                dist.all_gather_into_tensor(gathered[i], t, group=sender_pg)
            sync()
            times.append(time.perf_counter() - t0)
        res["gather"] = times
        del gathered
    flat_full, flat_mine, recv_shards = [], [], []  # free before the transport cases
    if gpu:
        torch.cuda.empty_cache()

    async def transports() -> None:
        for case in ("rank0", "sharded"):
            times = []
            if is_sender:
                if case == "rank0" and rank != 0:  # rank 0 alone sends the whole weights
                    for _ in range(rounds + 1):
                        await asyncio.to_thread(barrier.wait)
                        times.append(0.0)
                    res[case] = times
                    continue
                group = "bench" if case == "rank0" else sender_group("bench", rank)
                pub = CollectivePublisher(backend, address, receivers=receivers, group=group, timeout_s=600,
                                          register=case == "rank0", master_address=here)
                for v in range(1, rounds + 2):
                    await asyncio.to_thread(barrier.wait)
                    t0 = time.perf_counter()
                    await pub.publish(v, full if case == "rank0" else mine)  # type: ignore[arg-type]
                    sync()
                    times.append(time.perf_counter() - t0)
                    await pub.settle()  # background RPCs, outside the timed region (as in `bench weights`)
                await pub.close()
            else:
                fetcher: Any = (CollectiveFetcher(backend, address, consumer_id=f"r{rank}", group="bench", timeout_s=600)
                                if case == "rank0" else
                                ShardedFetcher(backend, address, consumer_id=f"r{rank}", senders=senders, group="bench",
                                               timeout_s=600))
                for v in range(1, rounds + 2):
                    await asyncio.to_thread(barrier.wait)
                    t0 = time.perf_counter()
                    got = await _drain(fetcher.fetch(common_pb2.WeightsRef(policy_version=v)))
                    sync()
                    times.append(time.perf_counter() - t0)
                    assert got == total, f"{case}: received {got} of {total} bytes"
                await fetcher.close()
            res[case] = times

    asyncio.run(transports())
    dist.destroy_process_group()
    out.put(res)


def _bucket_sizes(total: int, bucket: int) -> list[int]:
    from .weights import plan_sizes

    return [sum(n for _, _, n in b) for b in plan_sizes(total, bucket)]


def _shard_plan(total: int, bucket: int, rank: int, senders: int) -> list[list[int]]:
    """Bytes of `rank`'s rows of each tensor, per bucket (the shapes make_weights gives)."""
    from .weights import plan_sizes

    out = []
    for b in plan_sizes(total, bucket):
        part = []
        for _, dtype, n in b:
            size = torch.empty(0, dtype=dtype).element_size()
            numel = n // size
            rows, width = (numel // 1024, 1024) if numel % 1024 == 0 else (numel, 1)
            a, z = _rows(rows, rank, senders)
            if z > a:
                part.append((z - a) * width * size)
        out.append(part)
    return out


MASTER_PORT = 29510
"""The benchmark group's store, cross-node: inside t0's namespace, where nothing else listens."""


def run_benchmark(*, size_gb: float = 4.0, bucket_mb: int = 512, rounds: int = 3, senders: int = 2,
                  receivers: int = 2, backend: str = "nccl", cross_node: bool = False,
                  link_mbit: float | None = None) -> dict[str, Any]:
    """`backend="gloo"`: the same cases on CPU processes (a functional check, not a measurement,
    unless `cross_node` with `link_mbit`: each rank on a node of its own, behind a link of that
    speed; root and iproute2)."""
    from services.common.config.param_server import ParamServerConfig
    from services.param_server.server import ParamServerServer

    total = int(size_gb * GiB)
    bucket = bucket_mb * MiB
    world = senders + receivers
    if cross_node and backend != "gloo":
        raise SystemExit("--cross-node runs on CPUs: use --backend gloo")
    if link_mbit is not None and not cross_node:
        raise SystemExit("--link-mbit shapes the links between the ranks' nodes: add --cross-node")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise SystemExit(f"needs {world} GPUs ({senders} trainer ranks + {receivers} rollout ranks), "
                         f"found {torch.cuda.device_count()}")
    nodes = [f"t{r}" for r in range(senders)] + [f"r{r}" for r in range(receivers)]

    async def main(cluster: Any) -> list[dict[str, Any]]:
        server = ParamServerServer(ParamServerConfig(host=cluster.bridge_ip if cluster else "127.0.0.1", port=0,
                                                     retain_versions=1))
        await server.start()
        ctx = mp.get_context("spawn")
        out, barrier = ctx.Queue(), ctx.Barrier(world)
        if cluster is not None:
            master, port = cluster.ip("t0"), MASTER_PORT
        else:
            master = "127.0.0.1"
            with socket.socket() as s:
                s.bind((master, 0))
                port = s.getsockname()[1]
        procs = []
        for r in range(world):
            args = (r, senders, receivers, server.address, total, bucket, rounds, barrier, out, master, port, backend)
            if cluster is not None:
                from meshrl.netns_cluster import run_in_netns

                procs.append(ctx.Process(target=run_in_netns, args=(cluster.nodes[nodes[r]].netns, _worker, *args),
                                         daemon=True))
            else:
                procs.append(ctx.Process(target=_worker, args=args, daemon=True))
        for p in procs:
            p.start()
        got: list[dict[str, Any]] = []
        try:
            while len(got) < world:
                try:
                    got.append(out.get_nowait())
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError(f"a worker failed: exit codes {[p.exitcode for p in procs]}") from None
                    await asyncio.sleep(0.2)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            await server.stop()
        return got

    placement: dict[str, Any] = {"where": "processes of this host, over loopback"}
    if cross_node:
        import tempfile
        from pathlib import Path

        from meshrl.netns_cluster import netns_cluster

        with tempfile.TemporaryDirectory(prefix="meshrl-sharded-crossnode-") as work, \
                netns_cluster(nodes, work_dir=Path(work), ray=False, link_mbit=link_mbit) as cluster:
            got = asyncio.run(main(cluster))
            placement = {"link": "a veth per node on a Linux bridge, one network namespace per node, one machine",
                         "link_mbit": link_mbit, "param_server": cluster.bridge_ip,
                         "nodes": {n: cluster.ip(n) for n in nodes}}
    else:
        got = asyncio.run(main(None))
    per_rank = sorted(got, key=lambda r: r["rank"])
    result: dict[str, Any] = {
        "benchmark": "weights_sharded", "bytes": total, "bucket_bytes": bucket, "rounds": rounds,
        "senders": senders, "receivers": receivers, "placement": placement,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "backend": backend,
                    "gpus": [torch.cuda.get_device_name(i) for i in range(world)] if backend == "nccl" else []},
        "cases": {},
    }
    for case in ("raw_rank0", "raw_sharded", "rank0", "sharded"):
        rounds_ = [{"sync": max(r[case][i] for r in per_rank)} for i in range(rounds + 1)]
        result["cases"][case] = _summary(total, rounds_)["sync"]
    g = [{"gather": max(r["gather"][i] for r in per_rank if "gather" in r)} for i in range(rounds + 1)]
    result["cases"]["gather"] = _summary(total, g)["gather"]
    c = result["cases"]
    result["ratios"] = {
        "sharded_vs_rank0_speedup_median": round(c["rank0"]["median_s"] / c["sharded"]["median_s"], 3),
        "sharded_vs_rank0_plus_gather_speedup_median": round(
            (c["rank0"]["median_s"] + c["gather"]["median_s"]) / c["sharded"]["median_s"], 3),
        "raw_sharded_vs_raw_rank0_speedup_best": round(c["raw_rank0"]["best_s"] / c["raw_sharded"]["best_s"], 3),
        "rank0_of_raw_best": round(c["raw_rank0"]["best_s"] / c["rank0"]["best_s"], 3),
        "sharded_of_raw_best": round(c["raw_sharded"]["best_s"] / c["sharded"]["best_s"], 3),
    }
    if link_mbit is not None:  # the floor: a receiver's link carries the whole version, whoever sends it
        floor = total * 8 / (link_mbit * 1e6)
        result["line_rate_s"] = round(floor, 4)
        for case in ("raw_rank0", "raw_sharded", "rank0", "sharded"):
            result["ratios"][f"{case}_median_over_line_rate"] = round(c[case]["median_s"] / floor, 3)
    return result
