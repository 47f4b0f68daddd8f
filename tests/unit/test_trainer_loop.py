"""The trainer loop against a fake coordinator, with a real one-rank FSDP engine on a tiny model:
publishing and versions, checkpoints and resume, DAPO filtering, operator flags, decoupled mode,
the KL reference, metrics."""

from __future__ import annotations

import asyncio
import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from meshrl.v1 import common_pb2
from services.common.auth import Authorizer, Tokens
from services.common.errors import DataLoss, DeadlineExceeded, FailedPrecondition, MeshError, Unavailable
from services.common.grpc_util import LocalContext
from services.trainer import checkpoints
from services.trainer.core import LoopSettings, TrainerLoop
from services.trainer.engines.base import SequenceBatch
from services.trainer.group import LocalTrainGroup
from services.trainer.publisher import RankZeroPublisher
from services.trainer.servicer import TrainerServicer
from services.weights.in_process import InProcessPublisher
from services.weights.protocols import drain
from tests.unit.fsdp_helpers import build, make_spec
from tests.unit.trainer_fakes import FakeCoordinator, fake_algorithm, make_group


def _group(**spec_kw: Any) -> LocalTrainGroup:
    spec = make_spec(optim={"lr": 1e-2}, **spec_kw)
    return LocalTrainGroup(build(spec), spec.actor)


def _settings(tmp_path: Path, **kw: Any) -> LoopSettings:
    base: dict[str, Any] = {
        "trainer_id": "t0", "groups_per_step": 2, "checkpoint_dir": tmp_path / "ckpt", "fetch_timeout_ms": 0,
        "metrics_path": tmp_path / "metrics.jsonl", "bucket_bytes": 1 << 20,
    }
    return LoopSettings(**{**base, **kw})


def _fill(coord: FakeCoordinator, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        coord.queue.append(make_group(f"L{i}", [1.0, 0.0, 0.5, 0.0], seed=i))


def _run(loop: TrainerLoop, timeout_s: float = 300) -> None:
    asyncio.run(asyncio.wait_for(loop.run(), timeout=timeout_s))


def _export(group: LocalTrainGroup) -> dict[str, torch.Tensor]:
    return {k: v for b in group.engine.export_weights(1 << 30) for k, v in b}


@pytest.mark.parametrize("overlap", [False, True])
def test_trains_publishes_every_trigger_steps_and_checkpoints_at_the_end(tmp_path: Path, overlap: bool) -> None:
    coord = FakeCoordinator()
    _fill(coord, 6)
    group = _group()
    pub = InProcessPublisher(retain_versions=5)
    algo, loss = fake_algorithm()
    loop = TrainerLoop(_settings(tmp_path, overlap=overlap, trigger_parameter_sync_step=2), group, coord, pub, algo)
    _run(loop)
    assert loop.state == "finished" and loop.step == 3 and group.step == 3
    assert coord.resumes == [0]
    assert [c.policy_version for c in coord.commits] == [1, 2]  # step 2, then the unpublished step 3 at the end
    assert [s for s, _, _ in coord.checkpoints] == [3]
    assert coord.checkpoints[0][1] == 2
    final = _export(group)
    published = pub.get(2).weights
    assert all(torch.equal(published[k], final[k]) for k in final)
    assert coord.commits[-1].manifest_checksum == pub.get(2).ref.manifest_checksum
    # bypass mode: old = rollout logprobs; advantages are zero outside responses
    t = loss.seen[0]
    assert torch.equal(t["old_logprobs"], t["rollout_logprobs"])
    # the tokens at the trainer's version (all at 0 in step 1; none in step 3, at version 1) go to the loss
    assert torch.equal(loss.seen[0]["at_trainer_version"], t["rollout_logprobs"].ne(0).float())
    assert loss.seen[-1]["at_trainer_version"].sum() == 0
    # step 2 trains on weights one unpublished optimizer step past version 0: no token was generated
    # at them (else policy drift is reported as engine mismatch on every step after a window's first)
    assert len(loss.seen) == 3 and "at_trainer_version" not in loss.seen[1]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "perf/throughput_tokens_per_s", "perf/idle_ratio",
                "staleness/min", "staleness/mean", "staleness/max", "critic/rewards/mean", "training/policy_version"):
        assert key in lines[0], key
    assert 0.0 <= lines[0]["perf/idle_ratio"] <= 1.0
    assert lines[0]["training/groups"] == 2 and lines[0]["training/sequences"] == 8


class _SnapshotBeforeTrain(LocalTrainGroup):
    """Records the weights each train call starts from (= the weights after the previous step)."""

    def __init__(self, inner: LocalTrainGroup) -> None:
        super().__init__(inner.engine, inner.actor)
        self.before: list[dict[str, torch.Tensor]] = []

    async def train(self, batch: SequenceBatch, loss_fn: Any, *, temperature: float) -> Any:
        await self._exported()
        self.before.append(_export(self))
        return await super().train(batch, loss_fn, temperature=temperature)


class _SlowPublisher(InProcessPublisher):
    """Starts reading a version's buckets only after a while, as a busy transport would."""

    async def publish(self, version: int, buckets: Any) -> Any:
        await asyncio.sleep(0.3)
        return await super().publish(version, buckets)


@pytest.mark.parametrize("rank_zero", [False, True])
@pytest.mark.parametrize("trigger", [1, 2])
def test_overlap_publishes_each_version_as_trained_and_fetches_for_the_version_it_trains_at(
    tmp_path: Path, trigger: int, rank_zero: bool
) -> None:
    """With overlap the next step trains while version v is published, and its groups were fetched
    while the previous step trained: version v must still be the weights right after its step, and
    every fetch names the version its groups are trained at. rank_zero: the publisher runs where
    the group's rank 0 does (RankZeroPublisher, as the collective transports)."""
    coord = FakeCoordinator()
    _fill(coord, 8)
    group = _SnapshotBeforeTrain(_group())
    pub = _SlowPublisher(retain_versions=10)
    publisher: Any = pub
    if rank_zero:
        asyncio.run(group.start_sender(lambda: pub))
        publisher = RankZeroPublisher(lambda: pub)
    loop = TrainerLoop(
        _settings(tmp_path, overlap=True, trigger_parameter_sync_step=trigger), group, coord, publisher,
        fake_algorithm()[0],
    )
    _run(loop)
    assert loop.step == 4 and [c.policy_version for c in coord.commits] == list(range(1, 4 // trigger + 1))
    # version v = the weights after step v * trigger = what step v * trigger + 1 started from
    for v in range(1, 4 // trigger):
        published = pub.get(v).weights
        after = group.before[v * trigger]
        assert all(torch.equal(published[k], after[k]) for k in after), v
        assert not all(torch.equal(published[k], group.before[v * trigger - 1][k]) for k in after)
    # step s trains at version (s - 1) // trigger; its groups were asked for at that version
    # (every step but the first was fetched while the step before it trained)
    asked = {f["step"]: f["train_version"] for f in coord.fetches}
    assert asked == {s: (s - 1) // trigger for s in range(1, 5)}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["training/policy_version"] for x in lines] == [s // trigger for s in range(1, 5)]
    assert all(x["staleness/max"] == (x["step"] - 1) // trigger for x in lines)  # groups were made at v0


class _TaskError(Exception):
    """As ray.exceptions.RayTaskError: what the rank's task raised is its `cause`."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"task failed: {cause}")
        self.cause = cause


class _FailingBroadcast(InProcessPublisher):
    """A collective sender whose broadcast of a version in `fail` breaks off (`fail[v]` times,
    with `error`) after announce made it current (as CollectivePublisher marks it);
    `announced=False`: before."""

    def __init__(self, coord: FakeCoordinator, fail: dict[int, int], *, announced: bool = True,
                 error: type[MeshError] = DeadlineExceeded) -> None:
        super().__init__(retain_versions=10)
        self.coord, self.fail, self.announced, self.error = coord, dict(fail), announced, error
        self.attempts: list[int] = []
        self.announced_versions: set[int] = set()

    async def publish(self, version: int, buckets: Any) -> Any:
        self.attempts.append(version)
        if not self.fail.get(version):
            ref = await super().publish(version, buckets)
            # sent again: announced (committed) already, and the collective publisher returns the
            # ref it announced, so the commit after it is a no-op
            return common_pb2.WeightsRef(policy_version=version) if version in self.announced_versions else ref
        self.fail[version] -= 1
        async for _ in buckets:  # the export runs to its end
            continue
        exc = self.error(f"nccl broadcast of version {version} (group 'rollout'): a receiver is stuck")
        if self.announced:
            await self.coord.commit_version("t0", common_pb2.WeightsRef(policy_version=version))
            self.announced_versions.add(version)
            exc.announced_version = version  # type: ignore[attr-defined]
        raise _TaskError(pickle.loads(pickle.dumps(exc)))  # from the rank actor, through Ray


@pytest.mark.parametrize("overlap", [False, True])
def test_a_broadcast_a_peer_broke_off_is_sent_again_and_training_goes_on(tmp_path: Path, overlap: bool) -> None:
    """Version 2's broadcast stalls on a receiver (DEADLINE_EXCEEDED) after CommitVersion made it
    current: no receiver has it whole, and with one rollout rank nothing would come to train a
    version 3 on, so version 2 is sent again; it goes through, counted once."""
    coord = FakeCoordinator()
    _fill(coord, 8)
    group = _group()
    pub = _FailingBroadcast(coord, {2: 1})
    asyncio.run(group.start_sender(lambda: pub))
    loop = TrainerLoop(_settings(tmp_path, overlap=overlap, trigger_parameter_sync_step=1), group, coord,
                       RankZeroPublisher(lambda: pub), fake_algorithm()[0])
    _run(loop)
    assert loop.state == "finished" and loop.step == 4, loop.error
    assert pub.attempts == [1, 2, 2, 3, 4] and pub.versions == [1, 2, 3, 4]
    assert coord.policy_version == 4 and loop.failed_broadcasts == 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["training/failed_broadcasts"] == 1.0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_broadcast_that_failed_its_checksums_is_not_sent_again_and_training_goes_on(
    tmp_path: Path, overlap: bool
) -> None:
    """Version 2's broadcast fails its checksums (DATA_LOSS) after CommitVersion made it current:
    the loop goes on from it (version 3 is next, committed as usual), counts it, and its metrics
    rows say so."""
    coord = FakeCoordinator()
    _fill(coord, 8)
    group = _group()
    pub = _FailingBroadcast(coord, {2: 1}, error=DataLoss)
    asyncio.run(group.start_sender(lambda: pub))
    loop = TrainerLoop(_settings(tmp_path, overlap=overlap, trigger_parameter_sync_step=1), group, coord,
                       RankZeroPublisher(lambda: pub), fake_algorithm()[0])
    _run(loop)
    assert loop.state == "finished" and loop.step == 4, loop.error
    assert [c.policy_version for c in coord.commits] == [1, 2, 3, 4] and coord.policy_version == 4
    assert loop.failed_broadcasts == 1 and pub.attempts == [1, 2, 3, 4] and pub.versions == [1, 3, 4]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["training/failed_broadcasts"] == 1.0


class _SendsAgain(InProcessPublisher):
    """A collective sender that records each publish; a version sent again returns the ref it
    announced the first time (the commit after it is a no-op) and keeps the weights it sent."""

    def __init__(self) -> None:
        super().__init__(retain_versions=10)
        self.attempts: list[int] = []
        self.refs: dict[int, common_pb2.WeightsRef] = {}
        self.again: dict[int, dict[str, torch.Tensor]] = {}

    async def publish(self, version: int, buckets: Any) -> Any:
        self.attempts.append(version)
        if version in self.refs:
            self.again[version] = {k: v.clone() async for b in buckets for k, v in [(n, t) for n, t in b]}
            return self.refs[version]
        self.refs[version] = await super().publish(version, buckets)
        return self.refs[version]


class _Probe:
    """The param server's answer to the sender's probe: version `wanted` must go again, once
    (a replacement rollout rank waits for it). Once it went, the rollout generates again: the
    queue is refilled and ends."""

    def __init__(self, coord: FakeCoordinator, pub: _SendsAgain, wanted: int) -> None:
        self.coord, self.pub, self.wanted = coord, pub, wanted
        self.asked: list[int] = []
        self.closed = False

    async def __call__(self, version: int) -> bool:
        self.asked.append(version)
        if self.asked.count(self.wanted) == 1 and version == self.wanted:
            return True
        if len(self.pub.attempts) > len(set(self.pub.attempts)) or len(self.pub.versions) > self.wanted:
            if not self.coord.queue and not self.coord.finite:
                _fill(self.coord, 4, start=100)
                self.coord.finite = True
        return False

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(("overlap", "trigger"), [(False, 1), (True, 1), (False, 2)])
def test_a_version_a_replaced_rollout_rank_waits_for_is_sent_again_when_no_groups_come(
    tmp_path: Path, overlap: bool, trigger: int
) -> None:
    """A single rollout replica killed right after it loaded version 2: its replacement asks the
    collective group for version 2, which went through already, and nothing generates groups to
    train a version 3 on (the run stood still; chaos tier, 2026-12-06). A fetch that brings no
    groups now asks the param server (the probe), which says the group waits for version 2: it
    goes again, the same weights, and training goes on. Trained on since (trigger 2: one step
    after version 1), the weights go as the next version instead."""
    coord = FakeCoordinator(finite=False)
    _fill(coord, 4 if trigger == 1 else 6)
    group = _group()
    pub = _SendsAgain()
    asyncio.run(group.start_sender(lambda: pub))
    wanted = 2 if trigger == 1 else 1
    probe = _Probe(coord, pub, wanted)
    loop = TrainerLoop(_settings(tmp_path, overlap=overlap, trigger_parameter_sync_step=trigger), group, coord,
                       RankZeroPublisher(lambda: pub, wanted_again=probe), fake_algorithm()[0])
    _run(loop)
    assert loop.state == "finished", loop.error
    assert probe.asked[0] == wanted and probe.asked.count(wanted) >= 1
    if trigger == 1:
        assert loop.step == 4 and pub.attempts == [1, 2, 2, 3, 4] and pub.versions == [1, 2, 3, 4]
        sent = pub.get(2).weights
        assert set(pub.again[2]) == set(sent) and all(torch.equal(pub.again[2][k], sent[k]) for k in sent)
        assert [c.policy_version for c in coord.commits] == [1, 2, 3, 4]
    else:  # steps 1-2: version 1; step 3, then no groups: version 2 early; steps 4-5, then the end: version 3
        assert loop.step == 5 and pub.attempts == [1, 2, 3] and not pub.again
        assert [c.policy_version for c in coord.commits] == [1, 2, 3]
    assert loop.failed_broadcasts == 0


class _FailsBeforeItsAnnounce(InProcessPublisher):
    """A collective sender whose publish of version 2 fails transiently before its announce (the
    last version's manifest registration surfacing), once."""

    def __init__(self) -> None:
        super().__init__(retain_versions=10)
        self.attempts: list[int] = []

    async def publish(self, version: int, buckets: Any) -> Any:
        self.attempts.append(version)
        if version == 2 and self.attempts.count(2) == 1:
            await drain(buckets)  # the export runs to its end, as a sender's does
            raise Unavailable("registering version 1's manifest: the param server is unavailable")
        return await super().publish(version, buckets)


class _RefillingProbe:
    """A probe that never wants a version again; the first time it is asked, the rollout has
    generated more groups (the queue is refilled once, then ends)."""

    def __init__(self, coord: FakeCoordinator) -> None:
        self.coord = coord

    async def __call__(self, version: int) -> bool:
        if not self.coord.queue and not self.coord.finite:
            _fill(self.coord, 4, start=100)
            self.coord.finite = True
        return False

    async def close(self) -> None:
        """Nothing to release (the real probe closes its channel)."""


def test_a_publish_failure_settled_while_collecting_fails_the_loop_not_a_fetch_resync(tmp_path: Path) -> None:
    """With the overlap, the send-again probe after an empty fetch settles the publish in flight.
    Its transient failure was taken for a FetchBatch whose answer was lost: the loop re-synced and
    went on with its weights one version ahead of the committed one, and failed later on a
    train_version the coordinator refused. The publish's own error must fail the loop, as it does
    when the loop settles the publish anywhere else."""
    coord = FakeCoordinator(finite=False)
    _fill(coord, 4)
    group = _group()
    pub = _FailsBeforeItsAnnounce()
    asyncio.run(group.start_sender(lambda: pub))
    loop = TrainerLoop(_settings(tmp_path, overlap=True, trigger_parameter_sync_step=1), group, coord,
                       RankZeroPublisher(lambda: pub, wanted_again=_RefillingProbe(coord)), fake_algorithm()[0])
    with pytest.raises(Unavailable, match="registering version 1's manifest"):
        _run(loop, timeout_s=120)
    assert loop.state == "failed" and coord.resumes == [0], (loop.state, coord.resumes)


@pytest.mark.parametrize("case", ["sent again three times", "three versions in a row", "not announced"])
def test_a_broadcast_failure_stops_the_loop_when_no_rank_follows_or_the_version_is_not_current(
    tmp_path: Path, case: str
) -> None:
    coord = FakeCoordinator()
    _fill(coord, 10)
    group = _group()
    if case == "sent again three times":
        pub = _FailingBroadcast(coord, {2: 99})
    elif case == "three versions in a row":
        pub = _FailingBroadcast(coord, {2: 1, 3: 1, 4: 1}, error=DataLoss)
    else:
        pub = _FailingBroadcast(coord, {2: 1}, announced=False)
    asyncio.run(group.start_sender(lambda: pub))
    loop = TrainerLoop(_settings(tmp_path, trigger_parameter_sync_step=1), group, coord,
                       RankZeroPublisher(lambda: pub), fake_algorithm()[0])
    with pytest.raises(Exception) as raised:
        _run(loop)
    if case == "sent again three times":
        assert isinstance(raised.value, FailedPrecondition), raised.value
        assert "the last 3 weight broadcasts (up to version 2) all failed" in str(raised.value)
        assert loop.failed_broadcasts == 3 and coord.policy_version == 2 and pub.attempts == [1, 2, 2, 2]
    elif case == "three versions in a row":
        assert isinstance(raised.value, FailedPrecondition)
        assert "the last 3 weight broadcasts (up to version 4) all failed" in str(raised.value)
        assert loop.failed_broadcasts == 3 and coord.policy_version == 4
    else:  # not made current: going on would publish the next version out of order
        assert isinstance(raised.value, _TaskError) and loop.failed_broadcasts == 0 and coord.policy_version == 1


@pytest.mark.parametrize("overlap", [False, True])
def test_resume_continues_from_the_newest_checkpoint_and_republishes(tmp_path: Path, overlap: bool) -> None:
    coord = FakeCoordinator(finite=False)
    _fill(coord, 6)
    first = _group()
    loop = TrainerLoop(
        _settings(tmp_path, overlap=overlap, save_freq=1, total_steps=2, trigger_parameter_sync_step=1), first, coord,
        InProcessPublisher(), fake_algorithm()[0],
    )
    rows_at_save: list[tuple[int, list[int]]] = []
    save = first.save_checkpoint

    async def save_after_looking(path: Any) -> Any:  # which metrics rows exist when a checkpoint is taken
        rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
        rows_at_save.append((loop.step, [json.loads(r)["step"] for r in rows]))
        return await save(path)

    first.save_checkpoint = save_after_looking  # type: ignore[method-assign]
    _run(loop)
    assert [s for s, _, _ in coord.checkpoints] == [1, 2] and coord.policy_version == 2
    # a step's row is written before its checkpoint: a trainer lost in between cannot resume past a
    # step that has no row
    assert rows_at_save == [(1, [1]), (2, [1, 2])], rows_at_save
    saved = _export(first)
    (tmp_path / "ckpt" / "global_step_3.partial").mkdir()  # a crash mid-save is ignored
    assert checkpoints.newest(tmp_path / "ckpt") == tmp_path / "ckpt" / "global_step_2"

    # a restarted trainer: fresh engine, same checkpoint directory; the coordinator moved on to v3
    coord.policy_version = 3
    second = _group()
    pub = InProcessPublisher()
    loop2 = TrainerLoop(
        _settings(tmp_path, overlap=overlap, save_freq=1, total_steps=3, trigger_parameter_sync_step=1), second, coord, pub,
        fake_algorithm()[0],
    )
    _run(loop2)
    assert coord.resumes == [0, 2]
    assert loop2.step == 3 and second.step == 3
    restored = pub.get(4).weights  # the restored weights went out as version current + 1
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    assert coord.fetches[-1]["step"] == 3
    assert coord.policy_version == 5


@pytest.mark.parametrize("overlap", [False, True])
def test_dynamic_sampling_drops_flat_groups_reports_them_and_refills(tmp_path: Path, overlap: bool) -> None:
    coord = FakeCoordinator()
    coord.queue.extend([
        make_group("flat0", [1.0, 1.0, 1.0, 1.0]),
        make_group("ok0", [1.0, 0.0, 0.0, 0.0], seed=1),
        make_group("flat1", [0.0, 0.0, 0.0, 0.0], seed=2),
        make_group("ok1", [1.0, 1.0, 0.0, 0.0], seed=3),
        make_group("ok2", [0.0, 1.0, 0.0, 0.0], seed=4),
        make_group("ok3", [0.0, 1.0, 1.0, 0.0], seed=5),
    ])
    algo, _ = fake_algorithm(filter_groups=True)
    loop = TrainerLoop(_settings(tmp_path, overlap=overlap, total_steps=2), _group(), coord, InProcessPublisher(), algo)
    _run(loop)
    assert [f["num_groups"] for f in coord.fetches] == [2, 1, 1, 2]
    assert [f["filtered"] for f in coord.fetches] == [[], ["flat0"], ["flat1"], []]  # reported on the next fetch
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["training/filtered_groups"] == 2 and lines[0]["training/groups"] == 2
    assert all(int(x["training/groups"]) == 2 for x in lines)


@pytest.mark.parametrize("overlap", [False, True])
def test_dynamic_sampling_reports_the_groups_filtered_by_the_last_fetch_of_the_data(tmp_path: Path, overlap: bool) -> None:
    """The fetch that says the data is exhausted may bring groups the filter drops: they are
    reported as filtered all the same (else the final checkpoint has the coordinator count them
    consumed, in its totals and staleness histogram, though they were never trained)."""
    coord = FakeCoordinator()
    coord.queue.extend([
        make_group("ok0", [1.0, 0.0, 0.0, 0.0], seed=1),
        make_group("ok1", [0.0, 1.0, 0.0, 0.0], seed=2),
        make_group("ok2", [1.0, 1.0, 0.0, 0.0], seed=3),
        make_group("flat0", [1.0, 1.0, 1.0, 1.0], seed=4),
    ])
    algo, _ = fake_algorithm(filter_groups=True)
    loop = TrainerLoop(_settings(tmp_path, overlap=overlap), _group(), coord, InProcessPublisher(), algo)
    _run(loop)
    assert loop.state == "finished" and loop.step == 2
    reported = [i for f in coord.fetches for i in f["filtered"]]
    assert reported == ["flat0"], coord.fetches
    assert loop.pending_filtered == []


def test_dynamic_sampling_gives_up_after_max_num_gen_batches(tmp_path: Path) -> None:
    coord = FakeCoordinator(finite=False)
    coord.queue.extend(make_group(f"flat{i}", [1.0] * 4, seed=i) for i in range(6))
    algo, _ = fake_algorithm(filter_groups=True)
    loop = TrainerLoop(_settings(tmp_path, max_num_gen_batches=2), _group(), coord, InProcessPublisher(), algo)
    with pytest.raises(FailedPrecondition, match="max_num_gen_batches=2"):
        _run(loop)
    assert loop.state == "failed"


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_request_checkpoints_without_training_the_partial_batch(tmp_path: Path, overlap: bool) -> None:
    coord = FakeCoordinator(finite=False)
    _fill(coord, 2)
    group = _group()
    loop = TrainerLoop(_settings(tmp_path, overlap=overlap), group, coord, InProcessPublisher(), fake_algorithm()[0])

    async def scenario() -> None:
        task = asyncio.create_task(loop.run())
        while loop.step < 1:
            await asyncio.sleep(0.01)
        coord.queue.append(make_group("late", [1.0, 0.0, 0.0, 0.0]))
        coord.stop_requested = True
        await asyncio.wait_for(task, timeout=120)

    asyncio.run(scenario())
    assert loop.state == "finished" and loop.step == 1 and group.step == 1
    assert [s for s, _, _ in coord.checkpoints] == [1]
    assert "late" not in coord.delivered  # never handed out after stop


@pytest.mark.parametrize("overlap", [False, True])
def test_checkpoint_requests_from_coordinator_and_rpc(tmp_path: Path, overlap: bool) -> None:
    coord = FakeCoordinator(finite=False)
    _fill(coord, 2)
    loop = TrainerLoop(_settings(tmp_path, overlap=overlap), _group(), coord, InProcessPublisher(), fake_algorithm()[0])
    servicer = TrainerServicer(loop, trainer_id="t0", engine="fsdp", auth=Authorizer(Tokens(operator="secret")))

    async def scenario() -> None:
        task = asyncio.create_task(loop.run())
        while loop.step < 1:
            await asyncio.sleep(0.01)
        # operator RPC: served at the next step boundary while the loop waits for data
        resp = await asyncio.wait_for(
            servicer.SaveCheckpoint(None, LocalContext([("authorization", "Bearer secret")], trusted=False)), timeout=60
        )
        assert (resp.step, Path(resp.path).name) == (1, "global_step_1")
        # again, nothing trained since: the same checkpoint, not written (nor reported) twice
        again = await asyncio.wait_for(
            servicer.SaveCheckpoint(None, LocalContext([("authorization", "Bearer secret")], trusted=False)), timeout=60
        )
        assert (again.step, again.path) == (resp.step, resp.path) and len(coord.checkpoints) == 1
        status = await servicer.GetTrainerStatus(None, LocalContext())
        assert status.step == 1 and status.last_checkpoint_step == 1 and status.world_size == 1
        assert status.metrics["training/step"] == 1.0
        # coordinator flag: the next step's checkpoint comes from FetchBatch.checkpoint_requested
        _fill(coord, 2, start=10)
        while loop.step < 2:
            await asyncio.sleep(0.01)
        coord.checkpoint_requested = True
        while not coord.checkpoints or coord.checkpoints[-1][0] != 2:
            await asyncio.sleep(0.01)
        coord.stop_requested = True
        await asyncio.wait_for(task, timeout=60)

    asyncio.run(scenario())
    assert [s for s, _, _ in coord.checkpoints] == [1, 2]


def test_a_checkpoint_request_pending_when_the_run_ends_without_a_step_is_answered(tmp_path: Path) -> None:
    """A run whose data ends before any step writes no checkpoint: a SaveCheckpoint that came
    while it waited for data must fail as one made after the end does, not wait for ever."""
    coord = FakeCoordinator(finite=True)  # no data at all
    loop = TrainerLoop(_settings(tmp_path), _group(), coord, InProcessPublisher(), fake_algorithm()[0])

    fetch = coord.fetch_batch
    asked: list[asyncio.Future[Any]] = []

    async def fetch_after_a_request(*args: Any, **kw: Any) -> Any:
        if not asked:
            asked.append(loop.request_checkpoint())  # the operator's RPC, while the loop waits for data
        return await fetch(*args, **kw)

    coord.fetch_batch = fetch_after_a_request  # type: ignore[method-assign]

    async def scenario() -> None:
        await asyncio.wait_for(loop.run(), timeout=120)
        assert loop.state == "finished" and loop.step == 0
        with pytest.raises(FailedPrecondition):
            await asyncio.wait_for(asked[0], timeout=5)

    asyncio.run(scenario())


def test_save_checkpoint_rpc_needs_the_operator_token(tmp_path: Path) -> None:
    loop = TrainerLoop(_settings(tmp_path), _group(), FakeCoordinator(), InProcessPublisher(), fake_algorithm()[0])
    servicer = TrainerServicer(loop, trainer_id="t0", engine="fsdp",
                               auth=Authorizer(Tokens(rollout="r", trainer="t", operator="secret")))
    from services.common.errors import PermissionDenied, Unauthenticated

    with pytest.raises(Unauthenticated):
        asyncio.run(servicer.SaveCheckpoint(None, LocalContext(trusted=False)))
    with pytest.raises(PermissionDenied):  # the trainer role's token is not the operator's
        asyncio.run(servicer.SaveCheckpoint(None, LocalContext([("authorization", "Bearer t")], trusted=False)))


@pytest.mark.parametrize("overlap", [False, True])
def test_decoupled_mode_uses_window_start_parameters_and_reference(tmp_path: Path, overlap: bool) -> None:
    coord = FakeCoordinator()
    _fill(coord, 4)
    group = _group(with_ref=True)
    algo, loss = fake_algorithm()
    loop = TrainerLoop(
        _settings(tmp_path, overlap=overlap, bypass_mode=False, use_kl_loss=True, trigger_parameter_sync_step=2),
        group, coord, InProcessPublisher(), algo,
    )
    _run(loop)
    first, second = loss.seen[0], loss.seen[1]
    # step 1 starts the window: old = current = initial parameters = reference
    assert torch.allclose(first["old_logprobs"], first["ref_logprobs"], atol=1e-6)
    assert not torch.equal(first["old_logprobs"], first["rollout_logprobs"])
    # step 2 is in the same window: old logprobs come from the window-start (initial) parameters,
    # i.e. they equal the (frozen, initial) reference, not the parameters after step 1
    assert torch.allclose(second["old_logprobs"], second["ref_logprobs"], atol=1e-6)
    current = group.engine.compute_logprobs(_batch_of(loop, second)).logprobs
    assert not torch.allclose(current, second["old_logprobs"], atol=1e-4)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # verl times the old logprobs as timing_s/old_log_prob
    assert "rollout_corr/mismatch_kl_k3" in lines[0] and "timing_s/old_log_prob" in lines[0]
    # every token of step 1 was generated at version 0, the trainer's: all of it is engine mismatch
    assert lines[0]["rollout_corr/engine_token_fraction"] == 1.0
    assert lines[0]["rollout_corr/engine_mismatch_k3_kl"] == pytest.approx(lines[0]["rollout_corr/mismatch_kl_k3"], rel=1e-5)
    assert "rollout_corr/offpolicy_kl" not in lines[0]
    # decoupled mode: the loop computes the engine-mismatch split from the proximal logprobs;
    # the loss never sees that mask
    assert all("at_trainer_version" not in t for t in loss.seen)


def _batch_of(loop: TrainerLoop, seen: dict[str, torch.Tensor]) -> SequenceBatch:
    """Rebuild the batch of step 2 (groups L2, L3) to recompute its logprobs after training."""
    from services.trainer.convert import groups_to_batch

    groups = [make_group(f"L{i}", [1.0, 0.0, 0.5, 0.0], seed=i) for i in (2, 3)]
    batch = groups_to_batch(groups, loop.s.pad_token_id)
    assert torch.equal(batch.tensors["rollout_logprobs"], seen["rollout_logprobs"])
    return batch


@pytest.mark.parametrize("overlap", [False, True])
def test_exhausted_data_trains_the_last_partial_batch(tmp_path: Path, overlap: bool) -> None:
    coord = FakeCoordinator()
    _fill(coord, 3)
    loop = TrainerLoop(_settings(tmp_path, overlap=overlap), _group(), coord, InProcessPublisher(), fake_algorithm()[0])
    _run(loop)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["training/groups"] for x in lines] == [2, 1]


class _NotUpYet(FakeCoordinator):
    """ResumeTrainer answers with `codes` (one per call) before the coordinator is up."""

    def __init__(self, codes: list[Any]) -> None:
        super().__init__()
        self.codes = list(codes)

    async def resume_trainer(self, trainer_id: str, checkpoint_step: int) -> Any:
        import grpc

        if self.codes:
            code = self.codes.pop(0)
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="not up yet")
        return await super().resume_trainer(trainer_id, checkpoint_step)


def test_first_resume_trainer_waits_for_a_coordinator_that_is_not_up_yet(tmp_path: Path) -> None:
    import grpc

    # Serve's ingress answers NOT_FOUND before the coordinator app is deployed, UNAVAILABLE before
    # a proxy listens: the loop retries instead of failing the replica.
    coord = _NotUpYet([grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE])
    _fill(coord, 2)
    algo, _ = fake_algorithm()
    loop = TrainerLoop(_settings(tmp_path), _group(), coord, InProcessPublisher(), algo)
    _run(loop)
    assert loop.state == "finished" and coord.resumes == [0] and not coord.codes


@pytest.mark.parametrize(("codes", "wait_s"), [
    (["PERMISSION_DENIED"], 600.0),  # a real answer, not a coordinator that is starting
    (["UNAVAILABLE"], 0.0),  # trainer_service.coordinator_wait_s=0: fail at once
])
def test_resume_trainer_fails_on_other_codes_or_when_the_wait_is_over(
    tmp_path: Path, codes: list[str], wait_s: float
) -> None:
    import grpc

    coord = _NotUpYet([getattr(grpc.StatusCode, c) for c in codes])
    algo, _ = fake_algorithm()
    loop = TrainerLoop(_settings(tmp_path, coordinator_wait_s=wait_s), _group(), coord, InProcessPublisher(), algo)
    with pytest.raises(grpc.RpcError):
        _run(loop)
    assert loop.state == "failed" and coord.resumes == []


def test_kl_in_reward_takes_the_reference_logprobs_and_lands_in_the_advantages(tmp_path: Path) -> None:
    """algorithm.use_kl_in_reward without use_kl_loss: the loop computes the reference logprobs
    for it, applies the penalty before the correction and the advantages (verl's order) and
    reports it; it failed at the first step (the advantages ran before the old logprobs existed,
    and the reference only came with use_kl_loss)."""
    from services.common.config.actor_rollout_ref import ActorConfig
    from services.common.config.algorithm import AlgorithmConfig, KLControlConfig
    from services.trainer import algos
    from services.trainer.core import Algorithm

    coord = FakeCoordinator()
    _fill(coord, 2)
    group = _group(with_ref=True)
    cfg = AlgorithmConfig(adv_estimator="drgrpo", use_kl_in_reward=True, kl_penalty="low_var_kl",
                          kl_ctrl=KLControlConfig(kl_coef=0.5))
    seen: list[SequenceBatch] = []

    def advantages(batch: SequenceBatch) -> torch.Tensor:
        seen.append(batch)
        return algos.compute_advantages(batch, cfg)

    algo = Algorithm(advantages, algos.build_loss_fn(ActorConfig(), cfg),
                     reward_kl=lambda b: algos.apply_kl_in_reward(b, cfg))
    loop = TrainerLoop(_settings(tmp_path, bypass_mode=False, use_kl_loss=False), group, coord, InProcessPublisher(), algo)
    _run(loop)
    assert loop.step == 1 and len(seen) == 1
    batch = seen[0]
    assert "ref_logprobs" in batch.tensors and algos.KL_REWARD_KEY in batch.tensors
    # the reference is the initial policy and old the proximal (= initial) one: KL ~0, the
    # penalty ~0 but present; a perturbed reference makes the advantages move with it
    plain = algos.compute_advantages(batch, cfg.model_copy(update={"use_kl_in_reward": False}))
    assert torch.allclose(batch.tensors["advantages"], plain * batch.response_mask, atol=1e-5)
    shifted = SequenceBatch(batch.input_ids, batch.attention_mask, batch.response_mask,
                            tensors={**{k: v for k, v in batch.tensors.items() if k != algos.KL_REWARD_KEY},
                                     "ref_logprobs": batch.tensors["ref_logprobs"] - 0.5 * batch.response_mask},
                            seq_tensors=batch.seq_tensors)
    assert not torch.allclose(algos.compute_advantages(shifted, cfg), plain, atol=1e-3)
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["actor/reward_kl_penalty_coeff"] == 0.5
    assert row["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-5)
    assert "timing_s/ref" in row


def test_loop_survives_a_step_whose_tokens_are_all_rejected(tmp_path: Path) -> None:
    """Decoupled mode with a rejection threshold no token passes: the step's response mask is
    empty. The loop goes on (the engine skips the optimizer step); it died in compute_advantages."""
    from services.common.config.actor_rollout_ref import ActorConfig
    from services.common.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
    from services.trainer import algos
    from services.trainer.core import Algorithm

    rc = RolloutCorrectionConfig(bypass_mode=False, rollout_rs="token_k2", rollout_rs_threshold=1e-12)
    cfg = AlgorithmConfig(rollout_correction=rc)
    coord = FakeCoordinator()
    _fill(coord, 2)
    algo = Algorithm(lambda b: algos.compute_advantages(b, cfg), algos.build_loss_fn(ActorConfig(), cfg),
                     correct=lambda b: algos.apply_rollout_correction(b, cfg))
    loop = TrainerLoop(_settings(tmp_path, bypass_mode=False, use_kl_loss=False), _group(), coord, InProcessPublisher(), algo)
    _run(loop)
    assert loop.step == 1


def test_mismatch_kl_k3_stays_finite_for_a_token_the_rollout_found_very_unlikely(tmp_path: Path) -> None:
    # k3 = exp(-d) - 1 + d with d = rollout - old logprob: one token the engine sampled at
    # logprob -100 (the trainer's is near -5) gave exp(95) = inf in float32, so the step's
    # rollout_corr/mismatch_kl_k3 was inf (null in metrics.jsonl). verl clamps d to [-20, 20]
    # (SAFETY_BOUND) before the exp, as the split metrics beside it do.
    coord = FakeCoordinator()
    _fill(coord, 2)
    coord.queue[0].responses[0].logprobs[0] = -100.0
    loop = TrainerLoop(_settings(tmp_path, bypass_mode=False, total_steps=1), _group(), coord,
                       InProcessPublisher(), fake_algorithm()[0])
    _run(loop)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    k3 = line["rollout_corr/mismatch_kl_k3"]
    assert k3 is not None and math.isfinite(k3)
    assert k3 == pytest.approx(line["rollout_corr/engine_mismatch_k3_kl"], rel=1e-5)
