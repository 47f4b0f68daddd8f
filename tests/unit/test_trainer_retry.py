"""The trainer loop while its services are replaced (services/trainer/retry.py): a FetchBatch whose
answer was lost after it delivered groups, a CommitVersion, a ReportCheckpoint and a weight
publish that fail transiently. The loop goes on and trains every group exactly once; a failure
that is not transient still fails it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshrl.v1 import coordinator_pb2
from services.common.errors import InvalidArgument, Unavailable
from services.trainer.core import TrainerLoop
from services.weights.in_process import InProcessPublisher
from tests.unit.test_trainer_loop import _fill, _group, _run, _settings
from tests.unit.trainer_fakes import FakeCoordinator, fake_algorithm


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class _Restarting(FakeCoordinator):
    """Fails calls as a coordinator being restarted does. FetchBatch number `lose_fetch` delivers
    its groups and then fails (the answer was lost); ResumeTrainer puts groups delivered after its
    step back at the head of the queue, as the real coordinator does."""

    def __init__(self, lose_fetch: int, fail_commit: int, fail_report: int) -> None:
        super().__init__()
        self.lose_fetch, self.fail_commit, self.fail_report = lose_fetch, fail_commit, fail_report
        self.order: list[Any] = []
        self.calls = {"fetch": 0, "commit": 0, "report": 0}

    async def fetch_batch(self, trainer_id: str, step: int, num_groups: int, **kw: Any) -> coordinator_pb2.FetchBatchResponse:
        resp = await super().fetch_batch(trainer_id, step, num_groups, **kw)
        self.order.extend(resp.groups)
        self.calls["fetch"] += 1
        if self.calls["fetch"] == self.lose_fetch:
            raise _rpc_error(grpc.StatusCode.INTERNAL, "The actor died unexpectedly before finishing this task.")
        return resp

    async def commit_version(self, trainer_id: str, weights: Any) -> coordinator_pb2.CommitVersionResponse:
        self.calls["commit"] += 1
        if self.calls["commit"] == self.fail_commit:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return await super().commit_version(trainer_id, weights)

    async def report_checkpoint(self, trainer_id: str, step: int, policy_version: int, path: str) -> None:
        self.calls["report"] += 1
        if self.calls["report"] == self.fail_report:
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        await super().report_checkpoint(trainer_id, step, policy_version, path)

    async def resume_trainer(self, trainer_id: str, checkpoint_step: int) -> coordinator_pb2.ResumeTrainerResponse:
        back = [g for g in self.order if self.delivered.get(g.lease_id, -1) > checkpoint_step]
        for g in back:
            del self.delivered[g.lease_id]
            self.order.remove(g)
        self.queue.extendleft(reversed(back))
        resp = await super().resume_trainer(trainer_id, checkpoint_step)
        resp.requeued = len(back)
        return resp


class _FlakyPublisher(InProcessPublisher):
    """The param server dies during the upload of version `fail_version` (once)."""

    def __init__(self, fail_version: int) -> None:
        super().__init__(retain_versions=5)
        self.fail_version = fail_version
        self.attempts: list[int] = []

    async def publish(self, version: int, buckets: Any) -> Any:
        self.attempts.append(version)
        if version == self.fail_version and self.attempts.count(version) == 1:
            async for _ in buckets:  # part of the upload went out
                break
            raise Unavailable("PublishWeights: UNAVAILABLE: Stream removed")
        return await super().publish(version, buckets)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("lose_fetch", [1, 3])
def test_services_replaced_mid_run_lose_nothing_and_train_nothing_twice(
    tmp_path: Path, overlap: bool, lose_fetch: int
) -> None:
    coord = _Restarting(lose_fetch=lose_fetch, fail_commit=2, fail_report=1)
    _fill(coord, 10)
    pub = _FlakyPublisher(fail_version=3)
    algo, _ = fake_algorithm()
    loop = TrainerLoop(_settings(tmp_path, overlap=overlap, save_freq=2), _group(), coord, pub, algo)
    _run(loop)
    assert loop.state == "finished", loop.error
    # The lost answer's groups were put back and trained once; the run trained every group once.
    assert lose_fetch in [i + 1 for i in range(coord.calls["fetch"])] and len(coord.resumes) == 2, coord.resumes
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(int(x["training/groups"]) for x in lines) == 10 and loop.step == 5
    # Version 3 was published again after its upload failed; every version was committed once, in order.
    assert pub.attempts.count(3) == 2
    assert [c.policy_version for c in coord.commits] == [1, 2, 3, 4, 5]
    assert [s for s, _, _ in coord.checkpoints] == [2, 4, 5]


def test_a_failure_that_is_not_transient_fails_the_loop(tmp_path: Path) -> None:
    class _Rejects(FakeCoordinator):
        async def commit_version(self, trainer_id: str, weights: Any) -> coordinator_pb2.CommitVersionResponse:
            raise InvalidArgument("weights.manifest_checksum", "must be 64 hex digits")

    coord = _Rejects()
    _fill(coord, 4)
    algo, _ = fake_algorithm()
    loop = TrainerLoop(_settings(tmp_path), _group(), coord, InProcessPublisher(), algo)
    with pytest.raises(InvalidArgument):
        asyncio.run(asyncio.wait_for(loop.run(), timeout=300))
    assert loop.state == "failed" and loop.error == "InvalidArgument: weights.manifest_checksum: must be 64 hex digits"
