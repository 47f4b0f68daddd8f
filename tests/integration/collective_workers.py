"""Processes for the collective-transport tests (spawned: importable, no pytest)."""

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


def make_buckets(seed: int, device: str = "cpu") -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    buckets = [
        [("model.embed_tokens.weight", torch.randn(300, 7, generator=g).bfloat16()),
         ("model.norm.weight", torch.randn(13, generator=g)), ("flag", torch.tensor(True))],
        [("model.layers.0.mlp.down_proj.weight", torch.randn(1000, 100, generator=g))],
        [("lm_head.weight", torch.randn(5, 7, generator=g).bfloat16())],
    ]
    return [[(n, t.to(device)) for n, t in b] for b in buckets]


def make_many_buckets(seed: int, device: str = "cpu", count: int = 10) -> list[list[tuple[str, torch.Tensor]]]:
    """More buckets than either side has slots, of different sizes (each receive is posted from
    the size the previous step announced)."""
    g = torch.Generator().manual_seed(seed)
    return [[(f"model.layers.{i}.weight", torch.randn(50 + 37 * i, 11, generator=g).to(device))] for i in range(count)]


def make_delta_buckets(version: int, device: str = "cpu") -> list[list[tuple[str, torch.Tensor]]]:
    """Version v of a model whose every version changes ~1% of each large tensor's elements (the
    same function of v on every side): what delta sync sends as changed elements."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(400, 300, generator=g).bfloat16()  # 240 KB: sent as a delta
    mlp = torch.randn(200, 100, generator=g)  # fp32, 80 KB: a delta too
    norm = torch.randn(13, generator=g).bfloat16()  # small: always whole
    for k in range(1, version + 1):
        gk = torch.Generator().manual_seed(k)
        for t in (emb, mlp, norm):
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=gk)
            flat[idx] = flat[idx] + float(k)
    buckets = [[("model.embed_tokens.weight", emb), ("model.norm.weight", norm), ("flag", torch.tensor(version % 2 == 0))],
               [("model.layers.0.mlp.down_proj.weight", mlp)]]
    return [[(n, t.to(device)) for n, t in b] for b in buckets]


def buckets_for(version: int, mode: str, device: str = "cpu") -> list[list[tuple[str, torch.Tensor]]]:
    if mode.startswith("delta"):
        return make_delta_buckets(version, device)
    return make_many_buckets(version, device) if mode.startswith("many") else make_buckets(version, device)


def _hanging(seed: int, hang_s: float) -> Iterator[list[tuple[str, torch.Tensor]]]:
    time.sleep(hang_s)  # the trainer stalls before the first bucket (a stuck peer)
    yield from make_buckets(seed)


def sender(address: str, backend: str, plan: list[tuple[int, str]], results: Any, timeout_s: float,
           notify: Any = None, receivers: int = 1, stall_s: float | None = None, down: Any = None) -> None:
    """Publish each (version, mode): mode "ok", "many" (make_many_buckets), "split" (the first
    bucket travels as two), "hang", "announce" (tell the receiver through `notify` first, as the
    trainer's CommitVersion tells rollouts through the coordinator), "generation" (the count is
    the generation of the group the version went out in, not the resent buckets), "resend" (as
    "generation"; a failed publish is reported, with its seconds as the count, and the version
    published again, as the trainer does when a peer broke a broadcast off) or "standby" (ask the
    param server's probe until it says the version must go again, as the trainer does while no
    groups come, then publish it again, as "generation") or "after_down" (wait until the harness
    stopped the param server (`down`), then as "generation")."""
    from services.weights.transports.collective import CollectivePublisher, SendAgainProbe

    async def main() -> None:
        if backend == "nccl":
            torch.cuda.set_device(0)
        async def announce(ref: Any) -> None:
            notify.put(ref.SerializeToString())

        pub = CollectivePublisher(backend, address, receivers=receivers, group="test", timeout_s=timeout_s,
                                  delta_sync=any(mode.startswith("delta") for _, mode in plan), stall_timeout_s=stall_s)
        for version, mode in plan:
            pub.announce = announce if mode == "announce" else None
            pub.wire_bucket_bytes = 2000 if mode == "split" else 512 << 20  # "split": 4 wire buckets, not 3
            try:
                device = "cuda" if backend == "nccl" else "cpu"
                buckets = _hanging(version, timeout_s + 2) if mode == "hang" else buckets_for(version, mode, device)
                if mode == "after_down":
                    await asyncio.to_thread(down.wait, 60)
                    mode = "generation"
                if mode == "standby":
                    probe = SendAgainProbe(address, ["test"])
                    try:
                        while not await probe(version):
                            await asyncio.sleep(0.2)
                    finally:
                        await probe.close()
                    mode = "generation"
                if mode == "resend":
                    t = time.monotonic()
                    try:
                        await pub.publish(version, buckets)
                        results.put(("sent", version, "went through at once", 0))
                        continue
                    except Exception as exc:  # the trainer sends a version a peer broke off again
                        results.put(("sent", version, f"{type(exc).__name__}: {exc}", time.monotonic() - t))
                    buckets, mode = buckets_for(version, mode, device), "generation"
                ref = await pub.publish(version, buckets)
                outcome = "announced ref" if mode == "announce" and not ref.manifest_checksum else ref.manifest_checksum
                if pub.delta is not None:
                    last = pub.delta.last.as_dict()
                    outcome = f"base={last['base_version']} sent_fraction={last['sent_fraction']:.4f}"
                count = pub.group.generation if mode == "generation" and pub.group else pub.resent_buckets
                results.put(("sent", version, outcome, count))
            except Exception as exc:
                results.put(("sent", version, f"{type(exc).__name__}: {exc}", pub.resent_buckets))
        await pub.close()

    asyncio.run(main())


def receiver(address: str, backend: str, plan: list[tuple[int, str, float]], results: Any, notify: Any = None,
             consumer_id: str = "rollout-0", role: str = "recv", gate: Any = None, stall_s: float | None = None) -> None:
    """Fetch each (version, mode, timeout_s): mode "ok", "corrupt" (damage bucket 1 once),
    "corrupt_meta" (a bit of bucket 1's metadata, once),
    "corrupt_last" (bucket 2, the last, once), "corrupt_always" (bucket 1, every time it comes),
    "many" / "many_corrupt" (the sender's make_many_buckets; bucket 5 damaged once), "announced"
    (wait for the sender's announcement and fetch the ref it carries), "delta" (delta sync:
    make_delta_buckets), "delta_drift" (delta sync after one element of this receiver's copy
    of the base was changed by hand) or "delta_corrupt_base" (delta sync, bucket 0, the one
    carrying #delta.base, damaged once: its resend lands after the buckets behind it). With delta
    sync the count is the version's base. "ok_then_fail": fetched whole, then the receiver fails the
    version after the sender finished it (its load failed: it drops its group) and reports that at
    its next check-in. "die": the process exits at once, as a killed rollout replica does (no
    goodbye to the group or the param server), after it opened `gate`; "die_mid": the same,
    once bucket 1 of the version arrived (mid-broadcast); "hang_mid": stuck for 10 s there, then
    as "retry". "replacement": wait for `gate`, then
    fetch (retrying while the param server says the group is full), as the replica that replaces
    a killed one does. "retry": a failed fetch is fetched again, as the rollout worker does."""
    from meshrl.v1 import common_pb2
    from services.common.errors import DeadlineExceeded, ResourceExhausted, Unavailable
    from services.weights.transports.collective import CollectiveFetcher

    state: dict[str, Any] = {"bucket": None, "always": False, "meta": False}

    def damage(step: int, bucket: int, buf: torch.Tensor) -> None:
        if state.get("hang") and bucket == 1:  # stuck (its event loop too), once
            state["hang"] = False
            time.sleep(10.0)
        if state.get("die") and bucket == 1:
            results.put((role, state["die"], "died", 0))
            time.sleep(1.0)  # the queue's feeder thread hands the result over
            gate.set()
            os._exit(0)
        if bucket == state["bucket"]:
            if not state["always"]:
                state["bucket"] = None
            if state["meta"]:  # a byte of the metadata that follows the bucket's bytes in the slot
                buf[-7] ^= 0x01
            else:
                buf[17] ^= 0xFF

    async def main() -> None:
        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(1 if torch.cuda.device_count() > 1 else 0)
            device = "cuda"
        fetcher = CollectiveFetcher(backend, address, consumer_id=consumer_id, group="test", corrupt_hook=damage,
                                    delta_sync=any(mode.startswith("delta") for _, mode, _ in plan), stall_timeout_s=stall_s)
        for version, mode, timeout_s in plan:
            if mode == "delta_drift":
                held = fetcher.delta.mirror["model.embed_tokens.weight"]  # type: ignore[union-attr]
                held.view(-1)[12345] += 1.0
            fetcher.timeout_s = timeout_s
            state["bucket"] = {"corrupt": 1, "corrupt_last": 2, "corrupt_always": 1, "many_corrupt": 5,
                               "corrupt_meta": 1, "delta_corrupt_base": 0}.get(mode)
            state["meta"] = mode == "corrupt_meta"
            state["always"] = mode == "corrupt_always"
            if mode == "die":
                results.put((role, version, "died", 0))
                time.sleep(1.0)  # the queue's feeder thread hands the result over
                gate.set()
                os._exit(0)
            state["die"] = version if mode == "die_mid" else None
            state["hang"] = mode == "hang_mid"
            if mode == "replacement":
                await asyncio.to_thread(gate.wait, 60)
            try:
                ref = common_pb2.WeightsRef(policy_version=version)
                if mode == "announced":
                    ref = common_pb2.WeightsRef.FromString(await asyncio.to_thread(notify.get, True, 60))
                got = {}
                while True:
                    try:
                        async for bucket in fetcher.fetch(ref):
                            for name, t in bucket:
                                assert t.device.type == device
                                got[name] = t.cpu().clone()
                        break
                    except ResourceExhausted:  # the group is full: the rollout worker retries the same way
                        if mode != "replacement":
                            raise
                        await asyncio.sleep(0.5)
                    except (DeadlineExceeded, Unavailable) as exc:
                        if mode not in ("retry", "hang_mid"):
                            raise
                        results.put((role, version, f"{type(exc).__name__}: {exc}", 0))
                        await asyncio.sleep(0.5)
                want = {n: t for b in buckets_for(version, mode) for n, t in b}
                same = set(got) == set(want) and all(
                    got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in want.items()
                )
                count = fetcher.delta.last.base_version if fetcher.delta is not None else fetcher.nacks_sent
                results.put((role, version, "identical" if same else "DIFFERENT", count))
                if mode == "ok_then_fail":
                    fetcher.drop_group(failed=True)
            except Exception as exc:
                count = fetcher.delta.last.base_version if fetcher.delta is not None else fetcher.nacks_sent
                results.put((role, version, f"{type(exc).__name__}: {exc}", count))
        await fetcher.close()

    asyncio.run(main())


def keep_result(got: dict, result: tuple) -> None:
    """Store a worker's (role, version, outcome, count) as got[(role, version)] = (outcome, count);
    the same version reported again (a fetch retried, a version published again) goes under
    (role, version, "again"), then (role, version, "again", "again")."""
    role, version, outcome, count = result
    key: tuple = (role, version)
    while key in got:
        key = (*key, "again")
    got[key] = (outcome, count)


def run_pair(backend: str, sender_plan: list, receiver_plan: list, deadline_s: float = 240.0,
             more_receivers: tuple[list, ...] = (), *, sender_timeout_s: float = 8.0, group_receivers: int = 0,
             stall_timeout_s: float = 60.0, peer_stall_s: float | None = None, late_start_s: float = 0.0,
             restart_after: int = 0, down_s: float = 2.0) -> dict:
    """Run a sender and a receiver process (and one more per plan in `more_receivers`, whose
    results are keyed "recv1", "recv2", ...) against a param server in this process; returns
    {(role, version): (outcome, count), "versions": [...]}. The group has `group_receivers`
    receivers (0: every receiver process). `stall_timeout_s` is the param server's (the
    rendezvous' silence bound), `peer_stall_s` the members' (a step's wait on a peer). With
    `late_start_s`, the param server starts that long after the first result came (the workers
    are up: a receiver in "retry" mode reports the fetch that found none); with `restart_after`, once the sender and the
    first receiver reported that version it is stopped (the sender's "after_down" goes on then)
    and a new, empty one starts on its address `down_s` later, as Serve replaces a replica."""
    from services.common.config.param_server import ParamServerConfig
    from services.common.serve_util import free_port
    from services.param_server.server import ParamServerServer

    async def main() -> dict:
        port = free_port()
        config = ParamServerConfig(port=port, stall_timeout_s=stall_timeout_s)
        address = f"127.0.0.1:{port}"
        ctx = mp.get_context("spawn")
        results, notify, gate, down = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
        procs = [
            ctx.Process(target=sender, args=(address, backend, sender_plan, results, sender_timeout_s, notify,
                                             group_receivers or 1 + len(more_receivers), peer_stall_s, down), daemon=True),
            ctx.Process(target=receiver, args=(address, backend, receiver_plan, results, notify, "rollout-0",
                                               "recv", gate, peer_stall_s), daemon=True),
        ] + [
            ctx.Process(target=receiver, args=(address, backend, plan, results, None, f"rollout-{i}", f"recv{i}",
                                               gate, peer_stall_s), daemon=True)
            for i, plan in enumerate(more_receivers, start=1)
        ]
        for p in procs:
            p.start()
        got: dict = {}
        end = time.monotonic() + deadline_s
        if late_start_s:
            # once the workers are up: the first receiver reported a fetch that found nobody
            keep_result(got, await asyncio.to_thread(results.get, True, 120))
            await asyncio.sleep(late_start_s)
        server = ParamServerServer(config)  # it listens from here on
        await server.start()

        try:
            expected = len(sender_plan) + len(receiver_plan) + sum(len(p) for p in more_receivers)
            while len(got) < expected or (restart_after and not down.is_set()):  # failed attempts count too
                if restart_after and ("sent", restart_after) in got and ("recv", restart_after) in got and not down.is_set():
                    await server.stop()
                    down.set()
                    await asyncio.sleep(down_s)
                    server = ParamServerServer(config)
                    await server.start()
                try:
                    keep_result(got, results.get_nowait())
                except queue.Empty:
                    if time.monotonic() > end:
                        raise AssertionError(f"collective test timed out; results so far: {got}") from None
                    # a worker that exits 0 put all its results first ("die" too); any other exit crashed
                    if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
                        await asyncio.sleep(1.0)
                        if results.empty():
                            raise AssertionError(f"a worker died: {[p.exitcode for p in procs]}; results {got}") from None
                    await asyncio.sleep(0.1)
            # the sender registers each version's manifest in the background and waits for the
            # last registration when it closes: read the versions once it has exited
            while any(p.is_alive() for p in procs) and time.monotonic() < end:
                await asyncio.sleep(0.1)
            # what came after the count was reached (a retried fetch or publish reports each attempt)
            with contextlib.suppress(queue.Empty):
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


def check_nacks_and_abort(backend: str, deadline_s: float = 240.0) -> None:
    """A NACK mid-stream (ten buckets of different sizes: more than either side's slots), a NACK
    of the last bucket (its verdict comes at once, no DATA follows it), a bucket damaged every
    time (sent max_attempts = 3 times, then DataLoss on both sides), then the group re-forms."""
    got = run_pair(
        backend,
        sender_plan=[(1, "many"), (2, "ok"), (3, "ok"), (4, "many")],
        receiver_plan=[(1, "many_corrupt", 120.0), (2, "corrupt_last", 120.0), (3, "corrupt_always", 120.0),
                       (4, "many", 120.0)],
        deadline_s=deadline_s,
    )
    # counts are cumulative: the receiver's NACKs, the sender's resent buckets
    assert got[("recv", 1)] == ("identical", 1) and got[("sent", 1)][1] == 1, got
    assert got[("recv", 2)] == ("identical", 2) and got[("sent", 2)][1] == 2, got
    assert got[("recv", 3)][0].startswith("DataLoss") and got[("recv", 3)][1] == 5, got
    assert got[("sent", 3)][0].startswith("DataLoss") and "3 times" in got[("sent", 3)][0], got
    assert got[("sent", 3)][1] == 4, got
    assert got[("recv", 4)] == ("identical", 5) and len(got[("sent", 4)][0]) == 64, got
    assert got["versions"] == [2, 4], got


def check_steady_group_version_mismatch(backend: str, deadline_s: float = 240.0) -> None:
    """Once a version went through, both sides start the next on the same group without waiting at
    the rendezvous. The receiver skips version 3 and asks for 4 while the sender sends 3: the
    param server tells the sender that its receiver skipped the version (its background check-in
    fails at once; not a deadline), and the receiver, ahead, does not give 4 up: its check-in still
    waits at the param server and answers the new generation in which the sender sends 4 (a
    receiver that gave 4 up there left that check-in to answer the sender's rendezvous for a group
    nobody joined: the sender waited out its deadline). Version 5 goes through on the new group."""
    t0 = time.monotonic()
    got = run_pair(
        backend,
        sender_plan=[(1, "ok"), (2, "ok"), (3, "ok"), (4, "ok"), (5, "ok")],
        receiver_plan=[(1, "ok", 120.0), (2, "ok", 120.0), (4, "ok", 120.0), (5, "ok", 120.0)],
        deadline_s=deadline_s,
    )
    assert got[("recv", 1)][0] == "identical" and got[("recv", 2)][0] == "identical", got
    assert got[("sent", 3)][0].startswith("FailedPrecondition") and "asked for" in got[("sent", 3)][0], got
    assert got[("recv", 4)][0] == "identical" and len(got[("sent", 4)][0]) == 64, got
    assert got[("recv", 5)][0] == "identical" and len(got[("sent", 5)][0]) == 64, got
    assert got["versions"] == [4, 5], got
    assert time.monotonic() - t0 < 100, "the mismatch waited for a deadline"


def check_receiver_behind_gives_up_and_the_sender_moves(backend: str, deadline_s: float = 240.0) -> None:
    """The receiver asks for version 2 again (it is behind) while the sender starts version 3 on
    their steady group: CTRL(0) shows the mismatch on both sides. The receiver, behind, gives its
    version up (it is gone); the sender, ahead, keeps waiting for its background check-in instead
    of failing version 3, and when the receiver checks in for 3 (reporting the generation it
    failed in) that check-in answers the new generation: the sender posts step 0 again there and
    version 3 goes through within its deadline (8 s), version 4 on the same group."""
    t0 = time.monotonic()
    got = run_pair(
        backend,
        sender_plan=[(v, "generation") for v in (1, 2, 3, 4)],
        receiver_plan=[(1, "ok", 60.0), (2, "ok", 60.0), (2, "ok", 60.0), (3, "ok", 60.0), (4, "ok", 60.0)],
        deadline_s=deadline_s,
    )
    assert got[("recv", 2, "again")][0].startswith("FailedPrecondition"), got
    for version in (1, 2, 3, 4):
        assert got[("recv", version)][0] == "identical", got
    gen = got[("sent", 2)][1]
    assert got[("sent", 3)][1] == gen + 1 and got[("sent", 4)][1] == gen + 1, got
    assert got["versions"] == [3, 4], got
    assert time.monotonic() - t0 < 100, "the mismatch waited for a deadline"


def check_sender_moves_to_a_new_generation(backend: str, deadline_s: float = 240.0) -> None:
    """The sender starts a version on its steady group; a receiver that failed the last version
    after the sender finished it joins a new generation instead, and the sender's background
    check-in answers that generation before CTRL(0) went through on the old group: the sender
    posts step 0 again in the new one and the version goes through within its deadline (8 s)."""
    got = run_pair(
        backend,
        sender_plan=[(1, "generation"), (2, "generation"), (3, "generation"), (4, "generation")],
        receiver_plan=[(1, "ok", 60.0), (2, "ok_then_fail", 60.0), (3, "ok", 60.0), (4, "ok", 60.0)],
        deadline_s=deadline_s,
    )
    for version in (1, 2, 3, 4):
        assert got[("recv", version)][0] == "identical" and len(got[("sent", version)][0]) == 64, got
    gen = got[("sent", 2)][1]
    assert got[("sent", 1)][1] == gen, got  # version 2 went out on the steady group
    assert got[("sent", 3)][1] == gen + 1, got  # version 3 moved to the generation the receiver joined
    assert got[("sent", 4)][1] == gen + 1, got
    assert got["versions"] == [3, 4], got


def check_a_replacement_takes_a_dead_receivers_place(backend: str, deadline_s: float = 240.0) -> None:
    """A group of two receivers; after version 2 one of them dies (no goodbye, as a killed rollout
    replica) while the sender starts version 3 on the steady group, and a replacement (a new member
    id) asks for version 3. The dead member held its rank: the replacement was turned away (the
    group is full) and the sender waited for the dead member until its deadline (here 60 s;
    param_server.transfer_timeout_s, 300 s, in a real run). Now the param server gives the dead
    member's place to the replacement once it has been silent for param_server.stall_timeout_s
    (3 s here): version 3 goes through, in the next generation, well within the deadline."""
    t0 = time.monotonic()
    got = run_pair(
        backend,
        sender_plan=[(v, "generation") for v in (1, 2, 3, 4)],
        receiver_plan=[(v, "ok", 60.0) for v in (1, 2, 3, 4)],
        more_receivers=([(1, "ok", 60.0), (2, "ok", 60.0), (3, "die", 60.0)],
                        [(3, "replacement", 60.0), (4, "ok", 60.0)]),
        sender_timeout_s=60.0, group_receivers=2, stall_timeout_s=3.0, deadline_s=deadline_s,
    )
    assert got[("recv1", 3)][0] == "died", got
    for version in (1, 2, 3, 4):
        assert got[("recv", version)][0] == "identical" and len(got[("sent", version)][0]) == 64, got
    assert got[("recv1", 1)][0] == got[("recv1", 2)][0] == "identical", got
    assert got[("recv2", 3)][0] == got[("recv2", 4)][0] == "identical", got
    gen = got[("sent", 2)][1]
    assert got[("sent", 3)][1] == gen + 1 and got[("sent", 4)][1] == gen + 1, got
    assert got["versions"] == [3, 4], got
    assert time.monotonic() - t0 < 55, "the sender waited for the dead member's deadline"


def check_the_only_receiver_replaced_after_a_version_gets_it_again(backend: str, deadline_s: float = 240.0) -> None:
    """A group of one receiver; it gets version 2 and dies (a single rollout replica killed right
    after loading it), and its replacement asks for version 2. The dead member had checked in for
    it, so its place was never given away: the replacement was turned away for good, and with no
    rollout generating the trainer sent no next version (the run stood still). Now the
    replacement takes the silent member's place (3 s here), the param server's probe says
    version 2 must go again, and the sender (as the trainer does while no groups come) sends it
    in the new generation; version 3 follows on that group."""
    t0 = time.monotonic()
    got = run_pair(
        backend,
        sender_plan=[(1, "generation"), (2, "generation"), (2, "standby"), (3, "generation")],
        receiver_plan=[(1, "ok", 60.0), (2, "ok", 60.0), (3, "die", 60.0)],
        more_receivers=([(2, "replacement", 60.0), (3, "ok", 60.0)],),
        sender_timeout_s=60.0, group_receivers=1, stall_timeout_s=3.0, deadline_s=deadline_s,
    )
    assert got[("recv", 1)][0] == got[("recv", 2)][0] == "identical" and got[("recv", 3)][0] == "died", got
    assert got[("recv1", 2)][0] == got[("recv1", 3)][0] == "identical", got
    gen = got[("sent", 2)][1]
    assert got[("sent", 1)][1] == gen and len(got[("sent", 2)][0]) == 64, got
    again = got[("sent", 2, "again")]
    assert len(again[0]) == 64 and again[0] == got[("sent", 2)][0] and again[1] == gen + 1, got
    assert got[("sent", 3)][1] == gen + 1 and got["versions"] == [2, 3], got
    assert time.monotonic() - t0 < 55, "the replacement waited for a deadline"


def check_delta_sync(backend: str, receivers: int = 1, deadline_s: float = 240.0) -> None:
    """Delta sync (param_server.delta_sync). Each version changes ~1% of every large tensor: the
    first goes whole, the next as deltas against the base every receiver holds (agreed at the
    rendezvous), rebuilt bit for bit. The first receiver's copy is altered by hand before version
    3: its rebuilt tensor fails the sender's fingerprint (DataLoss), version 4 goes whole to every
    receiver, version 5 is a delta again (on the first receiver, the bucket carrying the delta's
    base is damaged once: NACKed, resent after the others, and the version still rebuilds)."""
    timeout = 120.0 if backend == "nccl" else 60.0
    got = run_pair(
        backend,
        sender_plan=[(v, "delta") for v in range(1, 6)],
        receiver_plan=[(v, {3: "delta_drift", 5: "delta_corrupt_base"}.get(v, "delta"), timeout) for v in range(1, 6)],
        more_receivers=tuple([(v, "delta", timeout) for v in range(1, 6)] for _ in range(receivers - 1)),
        deadline_s=deadline_s,
    )
    roles = ["recv"] + [f"recv{i}" for i in range(1, receivers)]

    def sent(version: int) -> tuple[int, float]:
        assert got[("sent", version)][0].startswith("base="), got  # else the sender's error
        base, fraction = (part.split("=")[1] for part in got[("sent", version)][0].split())
        return int(base), float(fraction)

    assert sent(1) == (0, 1.0), got  # nobody holds a base yet
    for role in roles:
        assert got[(role, 1)] == ("identical", 0), got
        assert got[(role, 2)] == ("identical", 1), got  # rebuilt from version 1, bit for bit
    assert sent(2)[0] == 1 and sent(2)[1] < 0.15, got
    # the drifted copy: the rebuilt tensor does not match the sender's fingerprint of it
    assert got[("recv", 3)][0].startswith("DataLoss") and "drifted" in got[("recv", 3)][0], got
    # version 4 goes whole (the receivers no longer hold one base), version 5 is a delta again
    assert sent(4) == (0, 1.0), got
    assert sent(5)[0] == 4 and sent(5)[1] < 0.15, got
    for role in roles:
        assert got[(role, 4)] == ("identical", 0), got
        assert got[(role, 5)] == ("identical", 4), got


def check_a_broadcast_a_peer_broke_off_is_sent_again(backend: str, case: str, deadline_s: float = 240.0) -> None:
    """A group of two receivers; in the middle of version 3 (after bucket 1 arrived) one of them
    dies (case "dies": no goodbye, as a killed rollout replica; a replacement asks for version 3)
    or is stuck for 10 s (case "stalls"). The dying one had checked in for version 3, so the param
    server could not give its place away: with the version never sent again, the replacement was
    turned away for good and, with one rollout replica, no version came after (the run stalled).
    A stuck peer held the sender until its whole deadline (300 s in a real run; a backend need not
    notice). Now the sender's step fails at once on a peer the backend saw go, or once it has
    waited on one for the members' stall bound (3 s here); the sender publishes version 3 again, as
    the trainer does, and every live receiver, the replacement included, gets it in the next
    generation."""
    t0 = time.monotonic()
    others = (([(1, "ok", 60.0), (2, "ok", 60.0), (3, "die_mid", 60.0)], [(3, "replacement", 60.0), (4, "ok", 60.0)])
              if case == "dies" else ([(1, "ok", 60.0), (2, "ok", 60.0), (3, "hang_mid", 60.0), (4, "ok", 60.0)],))
    got = run_pair(
        backend,
        sender_plan=[(1, "generation"), (2, "generation"), (3, "resend"), (4, "generation")],
        receiver_plan=[(1, "ok", 60.0), (2, "ok", 60.0), (3, "retry", 60.0), (4, "ok", 60.0)],
        more_receivers=others, sender_timeout_s=60.0, group_receivers=2, stall_timeout_s=3.0, peer_stall_s=3.0,
        deadline_s=deadline_s,
    )
    first, seconds = got[("sent", 3)]
    if case == "dies":
        assert got[("recv1", 3)][0] == "died", got
        assert ("Unavailable" in first or "no progress for 3s" in first) and seconds < 20, got
        assert got[("recv2", 3)][0] == got[("recv2", 4)][0] == "identical", got
    else:
        assert "DeadlineExceeded" in first and "no progress for 3s" in first and seconds < 9, got
        stuck = [v for k, v in got.items() if k[:2] == ("recv1", 3)]
        assert stuck[-1][0] == "identical" and got[("recv1", 4)][0] == "identical", got
    gen = got[("sent", 2)][1]
    assert got[("sent", 3, "again")][1] > gen and got[("sent", 4)][1] == got[("sent", 3, "again")][1], got
    live = [v for k, v in got.items() if k[:2] == ("recv", 3)]
    assert live[-1][0] == "identical" and all("identical" not in o for o, _ in live[:-1]), got
    assert got[("recv", 4)][0] == "identical" and got["versions"] == [3, 4], got
    assert time.monotonic() - t0 < 55, "the sender waited for the peer until its deadline"


def check_a_param_server_away(backend: str, deadline_s: float = 240.0) -> None:
    """The param server is not up yet when the first version starts (up 3 s after the receiver's
    first fetch found none), and is replaced
    (stopped, an empty one started on its address 2 s later) between versions 2 and 3, version 3
    sent while it is down. The sender waits for it at the rendezvous and keeps registering
    version 3's manifest until the replacement answers (both failed the sender at once: the
    trainer's loop stopped); the receivers' fetches fail meanwhile and are retried, as the rollout
    worker does. Every version arrives whole; the replacement's generation is a new one, never
    the one the members still hold from before (they rebuild their group)."""
    got = run_pair(
        backend,
        sender_plan=[(1, "generation"), (2, "generation"), (3, "after_down"), (4, "generation"), (5, "generation")],
        receiver_plan=[(1, "retry", 60.0), (2, "ok", 60.0), (3, "retry", 60.0), (4, "retry", 60.0), (5, "ok", 60.0)],
        late_start_s=3.0, restart_after=2, sender_timeout_s=30.0, deadline_s=deadline_s,
    )
    for version in range(1, 6):
        assert len(got[("sent", version)][0]) == 64, got  # a manifest checksum, else the sender's error
        last = [v for k, v in got.items() if k[:2] == ("recv", version)][-1]
        assert last[0] == "identical", got
    assert any("Unavailable" in v[0] for k, v in got.items() if k[:2] == ("recv", 1)), got  # it was down
    gen = got[("sent", 2)][1]
    assert got[("sent", 1)][1] == gen == got[("sent", 3)][1], got  # version 3 on the steady group
    assert got[("sent", 4)][1] > gen and got[("sent", 5)][1] == got[("sent", 4)][1], got
    assert got["versions"] == [4, 5], got
