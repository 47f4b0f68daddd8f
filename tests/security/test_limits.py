"""Bounded resources: RPCs and streams per client, a stalled FetchWeights reader cut and its pin
released, upload quotas and concurrent uploads, holds per version, the coordinator's replica
table, a scorer past its deadline killed."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from meshrl.v1 import coordinator_pb2, coordinator_pb2_grpc
from meshrl.v1 import param_server_pb2 as pb
from services.common.config import load_config
from services.common.errors import ResourceExhausted, Unavailable
from services.common.grpc_util import create_channel
from services.coordinator.server import CoordinatorServer
from services.param_server.server import ParamServerServer
from services.reward.pool import ScoreDeadline
from services.reward.procpool import FunctionSpec, ProcessPool
from services.weights.client import ParamServerClient
from services.weights.transports.grpc import GrpcPublisher

from .mesh import OVERRIDES

HERE = Path(__file__).resolve().parent


async def _poll(predicate, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_streams_and_rpcs_per_client_are_bounded(tmp_path: Path) -> None:
    cfg = load_config(None, [*OVERRIDES, "security.limits.max_streams_per_client=2",
                             "security.limits.max_concurrent_rpcs_per_client=3"])

    async def main() -> None:
        server = CoordinatorServer(cfg, tmp_path)
        await server.start()
        channel = create_channel(server.address)
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        calls = [stub.WatchVersions(coordinator_pb2.WatchVersionsRequest(replica_id=f"r{i}")) for i in range(3)]
        try:
            got = []
            for c in calls:
                try:
                    await c.read()
                    got.append("open")
                except grpc.aio.AioRpcError as exc:
                    got.append(exc.code().name)
                    assert "max_streams_per_client=2" in (exc.details() or "")
            assert sorted(got) == ["RESOURCE_EXHAUSTED", "open", "open"]  # whichever arrived third
            # Two streams held: one more RPC fits under 3 in progress, a second waiting one does not.
            fetch = stub.FetchBatch(coordinator_pb2.FetchBatchRequest(trainer_id="t", num_groups=5, timeout_ms=5000))
            await asyncio.sleep(0.3)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            fetch.cancel()
            calls[got.index("open")].cancel()
            await asyncio.sleep(0.3)
            again = stub.WatchVersions(coordinator_pb2.WatchVersionsRequest(replica_id="r9"))
            await again.read()  # a slot was freed
            again.cancel()
        finally:
            for c in calls:
                c.cancel()
            await channel.close()
            await server.stop()

    asyncio.run(main())


def _weights(mb: int) -> list[list[tuple[str, torch.Tensor]]]:
    return [[(f"w{i}", torch.zeros(1 << 18, dtype=torch.float32))] for i in range(mb)]  # 1 MiB per bucket


def test_a_stalled_fetch_is_cut_and_its_pin_released(tmp_path: Path) -> None:
    cfg = load_config(None, [*OVERRIDES, "security.limits.stream_stall_timeout_s=1", "param_server.max_message_mb=8",
                             "param_server.chunk_mb=1"])

    async def main() -> None:
        server = ParamServerServer(cfg, tmp_path)
        await server.start()
        try:
            ref = await GrpcPublisher(server.address, chunk_bytes=1 << 20).publish(1, _weights(48))
            store = server.servicer.store
            async with ParamServerClient(server.address) as client:
                call = client.fetch(pb.FetchWeightsRequest(policy_version=ref.policy_version, chunk_bytes=1 << 20),
                                    timeout_s=120)
                await call.read()  # the manifest; then this reader stops reading
                stored = store.get(1)
                assert stored.readers == 1
                await _poll(lambda: stored.readers == 0)  # cut after ~1 s of no progress
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    while True:
                        if await call.read() is grpc.aio.EOF:
                            break
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "stream_stall_timeout_s" in (e.value.details() or "")
        finally:
            await server.stop()

    asyncio.run(main())


def test_upload_quota_and_concurrent_uploads(tmp_path: Path) -> None:
    cfg = load_config(None, [*OVERRIDES, "param_server.max_upload_mb=4", "param_server.max_concurrent_uploads=1"])

    async def main() -> None:
        server = ParamServerServer(cfg, tmp_path)
        await server.start()
        try:
            with pytest.raises(ResourceExhausted, match="max_upload_mb"):
                await GrpcPublisher(server.address, chunk_bytes=1 << 20).publish(1, _weights(6))
            assert server.servicer.store.versions() == [] and server.servicer.uploads_in_flight == 0

            async def early_bucket_over_quota() -> AsyncIterator[pb.PublishWeightsRequest]:
                # a bucket's metadata before the manifest: checked when the manifest opens the upload
                yield pb.PublishWeightsRequest(bucket=pb.BucketMeta(index=0, nbytes=8 << 20, fingerprint="0" * 32))
                yield pb.PublishWeightsRequest(manifest=pb.Manifest(policy_version=3))

            async with ParamServerClient(server.address) as a:
                with pytest.raises(ResourceExhausted, match="max_upload_mb"):
                    await a.publish(early_bucket_over_quota(), timeout_s=30)
            assert server.servicer.store._uploads == {}  # refused: nothing stays registered for version 3

            release = asyncio.Event()

            async def slow() -> AsyncIterator[pb.PublishWeightsRequest]:
                yield pb.PublishWeightsRequest(bucket=pb.BucketMeta(index=0, nbytes=8, fingerprint="0" * 32))
                await release.wait()

            async with ParamServerClient(server.address) as a, ParamServerClient(server.address) as b:
                first = asyncio.ensure_future(a.publish(slow(), timeout_s=30))
                await _poll(lambda: server.servicer.uploads_in_flight == 1)
                with pytest.raises(Unavailable, match="max_concurrent_uploads=1"):  # transient: publishers retry
                    await b.publish(slow(), timeout_s=30)
                first.cancel()
                release.set()
            await _poll(lambda: server.servicer.uploads_in_flight == 0)
            # A version within the quota goes through.
            ref = await GrpcPublisher(server.address, chunk_bytes=1 << 20).publish(2, _weights(2))
            assert ref.policy_version == 2
        finally:
            await server.stop()

    asyncio.run(main())


def test_holders_per_version_are_bounded(tmp_path: Path) -> None:
    cfg = load_config(None, [*OVERRIDES, "param_server.max_holders_per_version=3"])

    async def main() -> None:
        server = ParamServerServer(cfg, tmp_path)
        await server.start()
        try:
            await GrpcPublisher(server.address, chunk_bytes=1 << 20).publish(1, _weights(1))
            async with ParamServerClient(server.address) as c:
                for i in range(3):
                    await c.acquire(f"r{i}", 1)
                await c.acquire("r0", 1)  # renewing a hold is not a new holder
                with pytest.raises(ResourceExhausted, match="max_holders_per_version"):
                    await c.acquire("r3", 1)
                await c.release("r1", 1)
                await c.acquire("r3", 1)
        finally:
            await server.stop()

    asyncio.run(main())


def test_fresh_replica_ids_do_not_grow_status_without_bound(tmp_path: Path) -> None:
    from services.coordinator.core import MAX_REPLICAS_SEEN
    from services.coordinator.factory import build_servicer

    cfg = load_config(None, OVERRIDES)
    servicer = build_servicer(cfg, tmp_path)
    core = servicer.core
    now = time.time()
    for i in range(20_000):
        core.renew(f"replica-{i:05d}-" + "x" * 200, ["no-such-lease"], now + i * 1e-4)
    status = core.status(now + 3)
    assert len(status.active_replicas) == MAX_REPLICAS_SEEN
    assert status.active_replicas[-1].startswith("replica-19999")
    # And they age out: nothing is listed once a lease timeout has passed.
    core.renew("late", ["no-such-lease"], now + cfg.coordinator.lease_timeout_s + 10)
    assert core.status(now + cfg.coordinator.lease_timeout_s + 10).active_replicas == ["late"]
    core.ledger.close()


def test_a_scorer_past_its_deadline_is_killed() -> None:
    import services.common.config  # noqa: F401

    spin = FunctionSpec.custom(str(HERE / "scorer_fixture.py"), "spin")
    fine = FunctionSpec.custom(str(HERE / "scorer_fixture.py"), "exact")

    async def main() -> None:
        pool = ProcessPool(1)
        try:
            kw = {"data_source": "x", "solution_str": "4", "ground_truth": "4", "extra_info": {}}
            assert await pool.run(fine, kw, timeout_s=30) == 1.0
            (pid,) = pool.pids()
            t0 = time.monotonic()
            with pytest.raises(ScoreDeadline):
                await pool.run(spin, kw, timeout_s=0.5)
            assert time.monotonic() - t0 < 10
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # gone: its CPU is free, not burning on for seconds
            assert pool.killed == 1
            assert await pool.run(fine, kw, timeout_s=30) == 1.0  # a fresh worker takes the next call
            with pytest.raises(RuntimeError) as e:
                await pool.run(FunctionSpec.custom(str(HERE / "scorer_fixture.py"), "raises"), kw, timeout_s=30)
            assert (type(e.value).__name__, str(e.value)) == ("ValueError", "no")  # reads like the scorer's own
        finally:
            pool.close()

    asyncio.run(main())


def test_a_cancelled_scorer_call_never_hands_its_score_to_the_next_call() -> None:
    """A cancelled call (its gRPC deadline passed, its client went away) leaves its worker busy
    until the scorer answers; that worker must not take the next call meanwhile, or every later
    call on it reads the previous call's score from the pipe, silently."""
    echo = FunctionSpec.custom(str(HERE / "scorer_fixture.py"), "echo")

    def kw(value: int, sleep: float = 0.0) -> dict:
        return {"data_source": "x", "solution_str": str(value), "ground_truth": "", "extra_info": {"sleep": sleep}}

    async def main() -> None:
        pool = ProcessPool(2)  # two waiting threads: the cancelled call's thread still reads its pipe
        try:
            assert await asyncio.gather(pool.run(echo, kw(1), timeout_s=30), pool.run(echo, kw(2), timeout_s=30)) == [1.0, 2.0]
            for round_ in range(4):
                slow = asyncio.ensure_future(pool.run(echo, kw(1010, sleep=0.4), timeout_s=30))
                await asyncio.sleep(0.1)
                slow.cancel()
                values = range(100 * round_, 100 * round_ + 12)
                got = await asyncio.gather(*(pool.run(echo, kw(v, sleep=0.01), timeout_s=30) for v in values))
                assert got == [float(v) for v in values], (round_, got)
        finally:
            pool.close()

    asyncio.run(main())


def test_closing_the_pool_mid_call_ends_the_call_and_closes_each_pipe_once() -> None:
    """close() while a call's thread still reads its worker's pipe (a cancelled call, a replica
    shutting down): the call ends as ScorerCrashed, the pipe is closed by one side only (the pool
    and the thread both closing it raced into EBADF, or closed a descriptor opened meanwhile), and
    no process or descriptor is left behind."""
    from services.reward.procpool import ScorerCrashed

    echo = FunctionSpec.custom(str(HERE / "scorer_fixture.py"), "echo")
    kw = {"data_source": "x", "solution_str": "7", "ground_truth": "", "extra_info": {"sleep": 5}}
    fds_before = len(os.listdir("/proc/self/fd"))

    async def main() -> None:
        for round_ in range(3):
            pool = ProcessPool(1)
            assert await pool.run(echo, {**kw, "extra_info": {}}, timeout_s=30) == 7.0
            pid = pool.pids()[0]
            call = asyncio.ensure_future(pool.run(echo, kw, timeout_s=30))
            await asyncio.sleep(0.2)  # the call is on the pipe, its worker asleep
            canary_r, canary_w = os.pipe()  # a descriptor opened after the worker's pipe
            pool.close()
            with pytest.raises(ScorerCrashed):
                await asyncio.wait_for(call, 10)
            os.write(canary_w, b"x")  # still ours: nobody closed it by its number
            assert os.read(canary_r, 1) == b"x", round_
            os.close(canary_r), os.close(canary_w)
            assert pool.pids() == [] and not os.path.exists(f"/proc/{pid}"), round_  # killed and reaped
            with pytest.raises(ScorerCrashed, match="closed"):  # a closed pool spawns nothing more
                await pool.run(echo, kw, timeout_s=30)

    asyncio.run(main())
    assert len(os.listdir("/proc/self/fd")) <= fds_before


def test_the_reward_pipeline_kills_timed_out_scorers(tmp_path: Path) -> None:
    from services.reward.factory import build_pipeline
    from services.reward.samples import Sample

    cfg = load_config(None, [f"custom_reward_function.path={HERE / 'scorer_fixture.py'}",
                             "custom_reward_function.name=spin", "reward.item_timeout_s=0.5", "reward.num_workers=1"])

    async def main() -> None:
        pipeline = build_pipeline(cfg)
        try:
            scores = await pipeline.score([Sample(item_id="a", data_source="x", response="4", ground_truth="4")])
            assert scores[0].metrics["timeout"] == 1.0
            st = pipeline.status()
            assert st["pool"]["processes_killed"] == 1 and st["pool"]["abandoned_threads"] == 0
            assert pipeline.unhealthy_reason() is None
        finally:
            await pipeline.close()

    asyncio.run(main())


def test_a_publish_cancelled_mid_write_gives_its_buffers_back_only_after_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chunk write runs in an io thread that a cancelled call cannot stop: the upload's buffers
    return to the pool (where another upload may take them) only once that thread is done."""
    import threading

    from services.param_server.store import Upload

    real, entered, go = Upload.write, threading.Event(), threading.Event()

    def blocking_write(bucket: object, offset: int, data: object) -> None:
        entered.set()
        go.wait(30)
        real(bucket, offset, data)  # type: ignore[arg-type]

    monkeypatch.setattr(Upload, "write", staticmethod(blocking_write))
    cfg = load_config(None, [*OVERRIDES, "param_server.chunk_mb=1"])

    async def main() -> None:
        server = ParamServerServer(cfg, tmp_path)
        await server.start()
        try:
            publishing = asyncio.ensure_future(GrpcPublisher(server.address, chunk_bytes=1 << 20).publish(1, _weights(1)))
            await _poll(entered.is_set)
            publishing.cancel()
            await _poll(lambda: server.servicer.uploads_in_flight == 0)  # the call is over
            upload = server.servicer.store._uploads.get(1)
            assert upload is not None and not upload.aborted  # its buffer is still being written
            go.set()
            await _poll(lambda: 1 not in server.servicer.store._uploads and upload.aborted)
        finally:
            go.set()
            await server.stop()

    asyncio.run(main())
