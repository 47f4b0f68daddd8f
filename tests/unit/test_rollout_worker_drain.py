"""The rollout worker's leases through drains, failed weight loads and submits over the message
limit: a finish-in-flight drain finishes its groups (the weight retry goes on for them, a cut
sample is continued), and groups that each fit are submitted alone when the call they shared
was too large. No Ray: a hand-written engine, the shared fake coordinator
(tests/rollout_helpers.py) and a fake weight fetcher."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from meshrl.v1 import common_pb2, coordinator_pb2
from services.rollout.engines import Finish, SampleOutput
from services.rollout.engines.base import EngineHealth
from services.rollout.worker import RolloutWorker, WorkerSettings
from tests.rollout_helpers import FakeCoordinator, length_scorer, wait_for
from tests.rollout_helpers import chat_prompts as _prompts


class _Engine:
    """Hand-written engine with the contract's pause modes. A request runs until the test
    releases it (`release_all`, after which requests finish at once) or it is aborted; paused,
    nothing finishes but aborted requests. Each request yields two tokens per sample at the
    version loaded. `fail_loads`: the first that many load_weights calls take one bucket, then
    break (a transfer cut mid-version)."""

    name = "review-fake"

    def __init__(self, fail_loads: int = 0) -> None:
        self._version = 0
        self._paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._events: dict[str, asyncio.Event] = {}
        self._aborted: set[str] = set()
        self.auto = False
        self.fail_loads = fail_loads
        self.loads = 0
        self.requests: list[str] = []

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    def request_started(self, request_id: str) -> bool:
        return True

    def release_all(self) -> None:
        self.auto = True
        for ev in self._events.values():
            ev.set()

    async def generate(self, request: Any) -> list[SampleOutput]:
        rid = request.request_id
        self.requests.append(rid)
        ev = self._events.setdefault(rid, asyncio.Event())
        if self.auto:
            ev.set()
        await ev.wait()
        if rid not in self._aborted:
            await self._resumed.wait()  # keep / wait: finishes once resumed
        finish = Finish.ABORT if rid in self._aborted else Finish.LENGTH
        v = self._version
        n = min(2, request.sampling.max_tokens)
        return [SampleOutput(i, [5] * n, [-1.0] * n, [v] * n, finish, "a" * n) for i in range(request.sampling.n)]

    async def abort(self, request_id: str) -> bool:
        self._aborted.add(request_id)
        self._events.setdefault(request_id, asyncio.Event()).set()
        return True

    async def abort_all(self) -> dict[str, list[SampleOutput]]:
        for rid in list(self._events):
            await self.abort(rid)
        return {}

    async def pause(self, mode: str = "keep") -> None:
        self._paused = True
        self._resumed.clear()
        if mode == "abort":
            for rid, ev in self._events.items():
                if not ev.is_set():
                    self._aborted.add(rid)
                    ev.set()

    async def resume(self) -> None:
        self._paused = False
        self._resumed.set()

    async def load_weights(self, version: int, buckets: AsyncIterator[Any]) -> int:
        assert self._paused
        self.loads += 1
        n = 0
        async for _ in buckets:
            n += 1
            if self.loads <= self.fail_loads:
                raise ConnectionError("weight stream broke after a bucket")
        self._version = version
        return n

    async def health(self) -> EngineHealth:
        return EngineHealth(True)

    def stats(self) -> dict[str, float]:
        return {}

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True


class _Fetcher:
    async def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Any]:
        for i in range(3):
            yield i


def _make(tok: Any, engine: _Engine, coord: FakeCoordinator, **kw: Any) -> RolloutWorker:
    settings = WorkerSettings(replica_id="r0", idle_poll_s=kw.pop("idle_poll_s", 0.05), renew_interval_s=0.1, **kw)
    return RolloutWorker(engine, tok, coord, length_scorer, _Fetcher(), settings)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------


def test_finish_in_flight_drain_does_not_stop_the_weight_retry_that_would_unpause_the_engine(tok: Any) -> None:
    """partial_rollout keep: a version half-loaded leaves the engine paused until the background
    retry loads a whole one. A drain that finishes the groups in flight keeps that retry going for
    them (it stopped once draining: nothing resumed the engine, and the drain waited forever)."""
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1)
    coord = FakeCoordinator(_prompts(1), sampling)
    engine = _Engine(fail_loads=2)  # the update and the first retry break; the second retry loads
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        worker = _make(tok, engine, coord, partial_rollout=True, partial_rollout_mode="keep",
                       idle_poll_s=0.2, concurrent_groups=1)
        worker.start()
        await wait_for(lambda: "r0/L0" in engine.requests, timeout_s=10, what="the group generating")
        coord.push_version(common_pb2.WeightsRef(policy_version=1))
        await wait_for(lambda: worker._weights_failed and engine.paused, timeout_s=10, what="a half-loaded version")
        engine.release_all()  # the sample is done as soon as the engine runs again
        drain = asyncio.get_running_loop().create_task(worker.drain(finish_in_flight=True))
        done, _ = await asyncio.wait({drain}, timeout=5.0)
        seen["drain_finished"] = bool(done)
        seen["loads"] = engine.loads
        if not done:  # clean up: stop() returns the kept group's lease and aborts it
            await asyncio.wait_for(worker.stop(finish_in_flight=False), 10)
            await asyncio.wait_for(drain, 10)
        else:
            await asyncio.wait_for(worker.stop(), 10)

    asyncio.run(scenario())
    assert seen["drain_finished"], (
        f"drain(finish_in_flight=True) hung: the weight retry stopped after {seen['loads']} loads "
        "and the engine stays paused")
    assert [g.lease_id for g in coord.submitted] + coord.returned == ["L0"]


def test_a_weight_update_during_a_finish_in_flight_drain_does_not_submit_truncated_samples(tok: Any) -> None:
    """partial_rollout abort: a weight update during a drain that finishes the groups in flight
    cuts a kept group's samples; they are continued, not submitted cut (finish ABORT, partial
    tokens: trained as if the sample ended there)."""
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1)
    coord = FakeCoordinator(_prompts(1), sampling)
    engine = _Engine()

    async def scenario() -> None:
        worker = _make(tok, engine, coord, partial_rollout=True, partial_rollout_mode="abort", concurrent_groups=1)
        worker.start()
        await wait_for(lambda: "r0/L0" in engine.requests, timeout_s=10, what="the group generating")
        drain = asyncio.get_running_loop().create_task(worker.drain(finish_in_flight=True))
        await wait_for(lambda: worker.draining, timeout_s=10, what="the drain begun")
        coord.push_version(common_pb2.WeightsRef(policy_version=1))  # the trainer commits meanwhile
        await wait_for(lambda: engine.version == 1, timeout_s=10, what="the update")
        engine.release_all()
        assert await asyncio.wait_for(drain, 10) == (0, 1)
        await asyncio.wait_for(worker.stop(), 10)

    asyncio.run(scenario())
    assert [g.lease_id for g in coord.submitted] == ["L0"] and coord.returned == []
    for r in coord.submitted[0].responses:
        assert r.finish_reason != common_pb2.FINISH_REASON_ABORT, "a cut sample was submitted as it was"
        assert len(r.token_ids) > 2 and list(r.versions)[-1] == 1


class _SizeLimitedCoordinator(FakeCoordinator):
    """SubmitGroups over the message limit fails as gRPC does (RESOURCE_EXHAUSTED, sent message
    larger than max). The limit here fits any one group but not two."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.refused = 0

    async def submit(self, replica_id: str, groups: Any) -> coordinator_pb2.SubmitGroupsResponse:
        sizes = [g.ByteSize() for g in groups]
        if sum(sizes) > 1.5 * max(sizes):
            self.refused += 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details=f"Sent message larger than max ({sum(sizes)} vs. {int(1.5 * max(sizes))})")
        return await super().submit(replica_id, groups)


def test_groups_that_each_fit_are_not_failed_together_by_a_coalesced_submit_over_the_limit(tok: Any) -> None:
    """Groups finishing together share one SubmitGroups call, bounded by a count (max_submit_batch),
    not by bytes: long responses can pass coordinator.max_message_mb together though each fits.
    The call fails RESOURCE_EXHAUSTED; each group is then submitted alone (every group of the
    batch failed, its lease went back with an error, and the regenerated groups met the same)."""
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1)
    coord = _SizeLimitedCoordinator(_prompts(2), sampling)
    engine = _Engine()

    async def scenario() -> None:
        worker = _make(tok, engine, coord, concurrent_groups=2, batch_window_s=0.05)
        worker.start()
        await wait_for(lambda: {"r0/L0", "r0/L1"} <= set(engine.requests), timeout_s=10, what="two groups generating")
        engine.release_all()
        await wait_for(lambda: len(coord.submitted) == 2 or bool(coord.returned), timeout_s=10, what="an outcome")
        await asyncio.wait_for(worker.stop(), 10)

    asyncio.run(scenario())
    assert coord.refused >= 1  # they did share a call
    assert coord.returned == [] and coord.errors == [], f"leases failed and returned: {coord.errors}"
    assert sorted(g.lease_id for g in coord.submitted) == ["L0", "L1"]


def test_samples_still_cut_after_every_continuation_are_not_submitted(tok: Any) -> None:
    """Partial rollout, mode abort, the param server down: every retry of the update pauses in
    mode abort and cuts the group's samples again (no weight changes); once max_resubmits
    continuations were used, the group was submitted with its samples cut short (finish ABORT)
    and trained as if they ended there. Now its lease goes back (the prompt is re-queued)."""

    class Unreachable:
        def __init__(self) -> None:
            self.calls = 0

        async def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Any]:
            self.calls += 1
            raise ConnectionError("param server unreachable")
            yield  # an async generator that fails before its first bucket

    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=100, seed=1)
    coord = FakeCoordinator(_prompts(1), sampling)
    engine = _Engine()
    fetcher = Unreachable()

    async def scenario() -> None:
        settings = WorkerSettings(replica_id="r0", idle_poll_s=0.05, renew_interval_s=0.1, concurrent_groups=1,
                                  partial_rollout=True, partial_rollout_mode="abort", max_resubmits=3)
        worker = RolloutWorker(engine, tok, coord, length_scorer, fetcher, settings)  # type: ignore[arg-type]
        worker.start()
        await wait_for(lambda: "r0/L0" in engine.requests, timeout_s=10, what="the group generating")
        coord.push_version(common_pb2.WeightsRef(policy_version=1))
        await wait_for(lambda: bool(coord.returned) or bool(coord.submitted), timeout_s=30, what="the group's end")
        assert "still cut by weight updates after async_training.max_resubmits=3 continuations" in (worker.last_error or "")
        await asyncio.wait_for(worker.stop(), 10)

    asyncio.run(scenario())
    assert coord.returned[0] == "L0" and fetcher.calls >= 4
    for g in coord.submitted:  # a later lease of the prompt may finish once the loads stop cutting it
        assert common_pb2.FINISH_REASON_ABORT not in [r.finish_reason for r in g.responses]
