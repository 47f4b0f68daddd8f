"""The trainer's rank group when a call ends cancelled or a sender fails: a rank-0 publish that
ends cancelled fails its version (published() waited for ever); a sharded publish is out only
once every sender is done (its first error let the next version start beside it); a loop dead
of a CancelledError fails the health check (the replica was reported healthy)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from meshrl.v1 import common_pb2
from services.common.errors import Unavailable
from services.trainer.core import LoopSettings, TrainerLoop
from services.weights.in_process import InProcessPublisher
from tests.unit.trainer_fakes import FakeCoordinator, fake_algorithm

# ---- RankSender: a publish that ends cancelled ---------------------------------------------------


class _PublishEndsCancelled:
    """A publisher whose publish coroutine ends in CancelledError without anyone cancelling the
    sender (what a grpc.aio call raises when it is cancelled under it, e.g. its channel closed)."""

    async def publish(self, version: int, buckets: Any) -> common_pb2.WeightsRef:
        _ = [b async for b in buckets]  # takes the version, then ends as a cancelled call does
        raise asyncio.CancelledError()


def test_rank_sender_result_fails_rather_than_hangs_when_the_publish_ends_cancelled() -> None:
    from services.trainer.workers import RankSender

    sender = RankSender(_PublishEndsCancelled)  # type: ignore[arg-type]
    try:
        sender.publish(1, iter([]))
        outcome: list[BaseException | common_pb2.WeightsRef] = []

        def wait() -> None:  # TrainWorker.published: what the trainer's publish_weights awaits
            try:
                outcome.append(sender.result(1))
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)  # daemon: a hang must not block pytest's exit
        waiter.start()
        waiter.join(5.0)
        assert not waiter.is_alive(), "RankSender.result(1) never returned: the publish's end was lost"
        assert isinstance(outcome[0], BaseException)
    finally:
        sender.close(timeout_s=1.0)


class _FailsFirstAttempt:
    """A publisher whose first publish fails (a peer left mid-broadcast) and whose second, of the
    same version, succeeds a little later."""

    def __init__(self) -> None:
        self.calls = 0

    async def publish(self, version: int, buckets: Any) -> common_pb2.WeightsRef:
        _ = [b async for b in buckets]
        self.calls += 1
        if self.calls == 1:
            raise Unavailable("a peer left mid-broadcast (attempt 1)")
        await asyncio.sleep(0.2)
        return common_pb2.WeightsRef(policy_version=version, total_bytes=self.calls)


def test_rank_sender_a_version_sent_again_gets_its_own_outcome_not_the_failed_attempts() -> None:
    """The loop sends a version again after a failed broadcast (publish_weights(v), published(v)
    again). The failed attempt's entry outlived its result(), so the second attempt answered with
    the first one's error at once while the real resend ran unobserved: three such "failures"
    in milliseconds stopped the run."""
    from services.trainer.workers import RankSender

    publisher = _FailsFirstAttempt()
    sender = RankSender(lambda: publisher)  # type: ignore[arg-type,return-value]
    try:
        sender.publish(2, iter([]))
        with pytest.raises(Unavailable, match="attempt 1"):
            sender.result(2)
        sender.publish(2, iter([]))  # sent again
        ref = sender.result(2)
        assert (ref.policy_version, ref.total_bytes) == (2, 2), "the second attempt's own outcome"
        assert sender._results == {}, "no entry outlives its result"
    finally:
        sender.close(timeout_s=2.0)


# ---- RayTrainGroup.publish_weights: every sender done before the version is out --------------------


class _Remote:
    def __init__(self, call: Any) -> None:
        self._call = call

    def remote(self, *args: Any) -> Any:
        return asyncio.ensure_future(self._call(*args))


class _Rank:
    """A rank actor handle: publish_weights (the export) and published (its sender's outcome)."""

    def __init__(self, published: Any) -> None:
        async def export(version: int, bucket_bytes: int) -> None:
            return None

        self.publish_weights = _Remote(export)
        self.published = _Remote(published)


def test_a_sharded_publish_is_out_only_once_every_sender_is_done() -> None:
    from services.trainer.workers import RayTrainGroup

    async def scenario() -> tuple[bool, bool]:
        rank1_sending = asyncio.Event()
        rank1_done = asyncio.Event()

        async def rank0_published(version: int) -> bytes:
            await rank1_sending.wait()
            # a receiver stalled: an announced broadcast failure, which the loop accepts and goes on
            exc = Unavailable("receiver stalled")
            exc.announced_version = version  # type: ignore[attr-defined]
            raise exc

        async def rank1_published(version: int) -> bytes:
            rank1_sending.set()
            await rank1_done.wait()  # still broadcasting its shards of `version`
            return common_pb2.WeightsRef(policy_version=version).SerializeToString()

        w0, w1 = _Rank(rank0_published), _Rank(rank1_published)
        group = RayTrainGroup([w0, w1], "pg", [{"dp_rank": 0, "dp_size": 2}, {"dp_rank": 1, "dp_size": 2}], 0)
        group._senders = [w0, w1]  # start_sender with every_rank (param_server.collective_sharded)
        out = asyncio.ensure_future(group.publish_weights(1, 1 << 20))
        await asyncio.wait([out], timeout=0.5)
        returned_while_rank1_sends = out.done()
        rank1_done.set()
        await asyncio.wait([out])
        return returned_while_rank1_sends, rank1_done.is_set()

    returned_early, _ = asyncio.run(scenario())
    # the loop would take version 1 as current and start version 2 on rank 1's sender while its
    # broadcast of version 1 still runs (CollectivePublisher.publish does not wait for it)
    assert not returned_early, "publish_weights resolved while rank 1's sender was still publishing"


# ---- TrainerDeployment.check_health -------------------------------------------------------------------


class _CoordinatorCallCancelled(FakeCoordinator):
    async def resume_trainer(self, trainer_id: str, checkpoint_step: int) -> Any:
        raise asyncio.CancelledError()  # grpc.aio: the call was cancelled under it (its channel closed)


def test_health_check_fails_when_the_loop_died_of_a_cancelled_call(tmp_path: Path) -> None:
    from services.trainer import deployment

    # the replica class without its async __del__ (never run here: nothing to close)
    cls = type("Replica", (deployment.TrainerDeployment.func_or_class,), {"__del__": lambda self: None})
    replica = object.__new__(cls)
    settings = LoopSettings(trainer_id="t0", groups_per_step=1, checkpoint_dir=tmp_path / "ckpt")
    group = SimpleNamespace(step=0, world_size=1)
    loop = TrainerLoop(settings, group, _CoordinatorCallCancelled(), InProcessPublisher(), fake_algorithm()[0])  # type: ignore[arg-type]

    async def scenario() -> None:
        replica._task = asyncio.get_running_loop().create_task(loop.run())
        replica.parts = SimpleNamespace(loop=loop)
        await asyncio.wait([replica._task])

    asyncio.run(scenario())
    assert loop.state == "failed"  # the loop is dead and says so
    with pytest.raises(RuntimeError, match="trainer loop failed"):
        replica.check_health()  # ... but Serve hears "healthy" and never restarts the replica
