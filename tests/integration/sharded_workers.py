"""Processes for the sharded collective-sync tests (spawned: importable, no pytest): S trainer
ranks each broadcast the rows they own, R rollout ranks rebuild whole tensors."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Iterator
from typing import Any

import torch

from .collective_workers import keep_result


def full_weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "model.embed_tokens.weight": torch.randn(301, 7, generator=g).bfloat16(),  # uneven rows
        "model.layers.0.mlp.down_proj.weight": torch.randn(1000, 100, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(13, generator=g),  # 1-D
        "model.tiny.weight": torch.randn(1, 5, generator=g),  # fewer rows than senders: one rank owns it
        "lm_head.weight": torch.randn(6, 7, generator=g).bfloat16(),
    }


def weights_for(version: int, mode: str) -> dict[str, torch.Tensor]:
    """"delta": version v moves ~1% of the elements of version v-1 (delta sync's case); else random."""
    if mode != "delta":
        return full_weights(version)
    weights = full_weights(0)
    for k in range(1, version + 1):
        g = torch.Generator().manual_seed(k)
        for t in weights.values():
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)
            flat[idx] = flat[idx] + float(k)
    return weights


def owned_rows(rows: int, rank: int, senders: int) -> tuple[int, int]:
    """FSDP2's dim-0 split (torch.chunk): ceil(rows / senders) rows per rank, the last ones fewer or none."""
    chunk = -(-rows // senders)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def shard_buckets(version: int, rank: int, senders: int, device: str = "cpu",
                  mode: str = "ok") -> list[list[tuple[str, torch.Tensor]]]:
    """mode "megatron": ranks 0 and 1 own the tensors as megatron's TP ranks do (down_proj, a
    row-parallel weight, by columns; the others by rows) and every other rank is a data-parallel
    replica that sends nothing."""
    from services.weights.shards import shard_name

    out: list[tuple[str, torch.Tensor]] = []
    owners = min(senders, 2) if mode.startswith("megatron") else senders
    if rank >= owners:
        return []
    for name, t in weights_for(version, mode).items():
        if mode.startswith("megatron") and name.endswith("down_proj.weight"):
            start, stop = owned_rows(t.shape[1], rank, owners)
            out.append((shard_name(name, start, stop, t.shape[1], dim=1), t[:, start:stop].to(device)))
            continue
        start, stop = owned_rows(t.shape[0], rank, owners)
        if stop > start:
            out.append((shard_name(name, start, stop, t.shape[0]), t[start:stop].to(device)))
    if rank == 0:
        out.append(("flag", torch.tensor(True, device=device)))  # a tensor nobody shards travels whole
    return [out[:2], out[2:]]


def _hanging(version: int, rank: int, senders: int, hang_s: float) -> Iterator[list[tuple[str, torch.Tensor]]]:
    time.sleep(hang_s)  # this trainer rank stalls before its first bucket (a stuck peer)
    yield from shard_buckets(version, rank, senders)


def sender(address: str, backend: str, rank: int, senders: int, receivers: int, plan: list[tuple[int, str]],
           results: Any, timeout_s: float, again: Any = None) -> None:
    """Trainer rank `rank`: publish each (version, mode): "ok", "hang" (this rank stalls),
    "delta" (delta sync; the outcome is "ok base=B deltas=N": the base this rank's version went
    against, and how many of its tensors went as deltas) or "standby" (rank 0 asks the param
    server's probe, for every trainer rank's group, until it says the version must go again and
    then sets `again`; the other ranks wait for it; then each publishes it as "ok": the trainer
    asks once, in rank 0's process, and every rank sends. A rank asking on its own could find
    the groups no longer waiting once another rank had sent again)."""
    from services.weights.shards import sender_group
    from services.weights.transports.collective import CollectivePublisher, SendAgainProbe

    async def main() -> None:
        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = "cuda"
        pub = CollectivePublisher(backend, address, receivers=receivers, group=sender_group("test", rank),
                                  timeout_s=timeout_s, register=False, delta_sync=any(m in ("delta", "megatron_delta") for _, m in plan))
        for version, mode in plan:
            try:
                if mode == "standby" and rank > 0:
                    await asyncio.to_thread(again.wait, 60)
                elif mode == "standby":
                    probe = SendAgainProbe(address, [sender_group("test", r) for r in range(senders)])
                    try:
                        while not await probe(version):
                            await asyncio.sleep(0.2)
                    finally:
                        await probe.close()
                    again.set()
                buckets = (_hanging(version, rank, senders, timeout_s + 2) if mode == "hang"
                           else shard_buckets(version, rank, senders, device, mode))
                ref = await pub.publish(version, buckets)
                outcome = "ok" if ref.policy_version == version else "wrong ref"
                if pub.delta is not None:
                    outcome += f" base={pub.delta.last.base_version} deltas={pub.delta.last.delta_tensors}"
                results.put((f"sent{rank}", version, outcome, pub.resent_buckets))
            except Exception as exc:
                results.put((f"sent{rank}", version, f"{type(exc).__name__}: {exc}", pub.resent_buckets))
        await pub.close()

    asyncio.run(main())


def receiver(address: str, backend: str, index: int, senders: int, plan: list[tuple[int, str, float]],
             results: Any, gate: Any = None) -> None:
    """Rollout rank `index`: fetch each (version, mode, timeout_s): "ok", "corrupt" (damage the
    first bucket from trainer rank 1 once: NACKed and sent again), "die" (the process exits at
    once, as a killed rollout replica does, after it opened `gate`) or "replacement" (wait for
    `gate`, then fetch, retrying while the param server says a group is full, as the replica
    that replaces a killed one does)."""
    from meshrl.v1 import common_pb2
    from services.common.errors import ResourceExhausted
    from services.weights.transports.collective import ShardedFetcher

    state: dict[str, Any] = {"armed": False}

    def damage(step: int, bucket: int, buf: torch.Tensor) -> None:
        if state["armed"] and bucket == 0:
            state["armed"] = False
            buf[3] ^= 0xFF

    async def main() -> None:
        if backend == "nccl":
            torch.cuda.set_device(senders + index)
        fetcher = ShardedFetcher(backend, address, consumer_id=f"rollout-{index}", senders=senders, group="test",
                                 delta_sync=any(m in ("delta", "megatron_delta") for _, m, _ in plan))
        fetcher.parts[min(1, senders - 1)]._corrupt_hook = damage
        for version, mode, timeout_s in plan:
            for part in fetcher.parts:
                part.timeout_s = timeout_s
            state["armed"] = mode == "corrupt"
            if mode == "die":
                results.put((f"recv{index}", version, "died", 0))
                time.sleep(1.0)  # the queue's feeder thread hands the result over
                gate.set()
                os._exit(0)
            if mode == "replacement":
                await asyncio.to_thread(gate.wait, 60)
            try:
                got: dict[str, torch.Tensor] = {}
                while True:
                    try:
                        async for bucket in fetcher.fetch(common_pb2.WeightsRef(policy_version=version)):
                            for name, t in bucket:
                                assert name not in got, name
                                got[name] = t.cpu().clone()
                        break
                    except ResourceExhausted:  # a group is full: the rollout worker retries the same way
                        if mode != "replacement":
                            raise
                        got.clear()
                        await asyncio.sleep(0.5)
                want = {**weights_for(version, mode), "flag": torch.tensor(True)}
                same = set(got) == set(want) and all(got[n].dtype == t.dtype and torch.equal(got[n], t)
                                                     for n, t in want.items())
                results.put((f"recv{index}", version, "identical" if same else f"DIFFERENT {sorted(got)}",
                             fetcher.nacks_sent))
            except Exception as exc:
                results.put((f"recv{index}", version, f"{type(exc).__name__}: {exc}", fetcher.nacks_sent))
        await fetcher.close()

    asyncio.run(main())


def run_sharded(backend: str, senders: int, sender_plans: list[list[tuple[int, str]]],
                receiver_plans: list[list[tuple[int, str, float]]], deadline_s: float = 240.0,
                sender_timeout_s: float = 8.0, *, group_receivers: int = 0, stall_timeout_s: float = 60.0) -> dict:
    """S sender and R receiver processes against a param server in this process; returns
    {(role, version): (outcome, count)} (a version reported again: (role, version, "again")).
    Each group has `group_receivers` receivers (0: every receiver process); `stall_timeout_s` is
    the param server's (the rendezvous' silence bound)."""
    from services.common.config.param_server import ParamServerConfig
    from services.param_server.server import ParamServerServer

    async def main() -> dict:
        server = ParamServerServer(ParamServerConfig(port=0, stall_timeout_s=stall_timeout_s))
        await server.start()
        ctx = mp.get_context("spawn")
        results, gate, again = ctx.Queue(), ctx.Event(), ctx.Event()
        procs = [ctx.Process(target=sender, args=(server.address, backend, r, senders, group_receivers or len(receiver_plans),
                                                  plan, results, sender_timeout_s, again), daemon=True)
                 for r, plan in enumerate(sender_plans)]
        procs += [ctx.Process(target=receiver, args=(server.address, backend, i, senders, plan, results, gate), daemon=True)
                  for i, plan in enumerate(receiver_plans)]
        for p in procs:
            p.start()
        want = sum(len(p) for p in sender_plans) + sum(len(p) for p in receiver_plans)
        got: dict = {}
        end = time.monotonic() + deadline_s

        try:
            while len(got) < want:
                try:
                    keep_result(got, results.get_nowait())
                except queue.Empty:
                    if time.monotonic() > end:
                        raise AssertionError(f"sharded test timed out; results so far: {got}") from None
                    if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
                        await asyncio.sleep(1.0)  # a worker that finished its plan exits 0: only a failure counts
                        if results.empty():
                            raise AssertionError(f"a worker died: {[p.exitcode for p in procs]}; results {got}") from None
                    await asyncio.sleep(0.1)
            with contextlib.suppress(queue.Empty):  # what came after the count was reached
                while True:
                    keep_result(got, results.get_nowait())
            got["versions"] = [s.policy_version for s in server.servicer.store.versions()]
            return got
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            await server.stop()

    return asyncio.run(main())
