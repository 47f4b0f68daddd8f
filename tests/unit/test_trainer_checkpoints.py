"""The trainer's checkpoints across restarts: resume_path goes back once (restarts resume this
line's newest since, later checkpoints of the line given up are set aside), rotation never deletes
the checkpoint just reported, a checkpoint committed but not reported before a crash is reported on
resume, and a resume without optimizer state trains at the schedule's lr."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.config.actor_rollout_ref import CheckpointContentsConfig
from services.common.errors import NotFound
from services.trainer import checkpoints
from services.trainer.core import LoopSettings, TrainerLoop
from services.trainer.engines.batching import micro_batches_for
from services.trainer.group import LocalTrainGroup
from services.weights.in_process import InProcessPublisher
from tests.unit.fsdp_helpers import build, fixed_batch, make_spec, nll_loss
from tests.unit.trainer_fakes import FakeCoordinator, fake_algorithm, make_group


def _group() -> LocalTrainGroup:
    spec = make_spec(optim={"lr": 1e-2})
    return LocalTrainGroup(build(spec), spec.actor)


def _settings(tmp_path: Path, **kw: Any) -> LoopSettings:
    base: dict[str, Any] = {
        "trainer_id": "t0", "groups_per_step": 2, "checkpoint_dir": tmp_path / "ckpt", "fetch_timeout_ms": 0,
        "metrics_path": tmp_path / "metrics.jsonl", "bucket_bytes": 1 << 20, "coordinator_wait_s": 0.0,
    }
    return LoopSettings(**{**base, **kw})


def _fill(coord: FakeCoordinator, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        coord.queue.append(make_group(f"L{i}", [1.0, 0.0, 0.5, 0.0], seed=i))


def _run(loop: TrainerLoop) -> None:
    asyncio.run(asyncio.wait_for(loop.run(), timeout=120))


def _loop(tmp_path: Path, coord: FakeCoordinator, **kw: Any) -> TrainerLoop:
    return TrainerLoop(_settings(tmp_path, **kw), _group(), coord, InProcessPublisher(), fake_algorithm()[0])


def test_restart_under_resume_path_resumes_this_runs_newest_checkpoint(tmp_path: Path) -> None:
    """Serve restarts a crashed replica with the same config: resume_path's rollback is not done
    again (it undid what trained since, and once rotation had deleted the path, a path inside
    checkpoint_dir, the trainer could not start at all: NotFound on every attempt)."""
    coord = FakeCoordinator(finite=False)
    _fill(coord, 20)
    root = tmp_path / "ckpt"
    _run(_loop(tmp_path, coord, save_freq=1, total_steps=1, max_checkpoints_to_keep=1))  # an earlier run
    rollback = str(root / "global_step_1")
    same = {"resume_mode": "resume_path", "resume_from_path": rollback, "save_freq": 1, "max_checkpoints_to_keep": 1}
    _run(_loop(tmp_path, coord, total_steps=3, **same))  # resumed from step 1, saved 2 and 3
    assert checkpoints.newest(root) == root / "global_step_3"
    # the trainer crashes; Serve restarts the replica with the same config
    restarted = _loop(tmp_path, coord, total_steps=4, **same)
    try:
        _run(restarted)
    except NotFound as exc:
        pytest.fail(f"the restarted trainer cannot resume at all: {exc}")
    assert coord.resumes[-1] == 3, coord.resumes  # not a rollback to step 1


def test_a_resume_path_recorded_relative_is_the_same_path_given_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that went back to resume_from_path=ckpt/global_step_1 recorded it relative; resumed
    after `meshrl train` began making paths absolute (025c251), it is given the absolute path,
    which the bare string comparison took for another: the trainer went back to step 1 again."""
    monkeypatch.chdir(tmp_path)
    coord = FakeCoordinator(finite=False)
    _fill(coord, 20)
    root = tmp_path / "ckpt"
    _run(_loop(tmp_path, coord, save_freq=1, total_steps=1, max_checkpoints_to_keep=3))  # an earlier run
    same = {"resume_mode": "resume_path", "save_freq": 1, "max_checkpoints_to_keep": 3}
    _run(_loop(tmp_path, coord, total_steps=3, resume_from_path="ckpt/global_step_1", **same))
    assert checkpoints.resumed_from(root).path == "ckpt/global_step_1"  # type: ignore[union-attr]
    _run(_loop(tmp_path, coord, total_steps=4, resume_from_path=str(root / "global_step_1"), **same))
    assert coord.resumes[-1] == 3, coord.resumes  # not a rollback to step 1


def test_restart_under_disable_goes_on_in_its_session_and_a_new_session_starts_over(tmp_path: Path) -> None:
    """resume_mode=disable went back to step 0 at every start, Serve's restart of a crashed replica
    included: the run's checkpoints were set aside, the coordinator re-queued every group since
    step 0, and the initial weights went out as the next version. Once per run session now."""
    coord = FakeCoordinator(finite=False)
    _fill(coord, 30)
    root = tmp_path / "ckpt"
    same = {"resume_mode": "disable", "save_freq": 1, "session": "s1"}
    first = _loop(tmp_path, coord, total_steps=2, **same)
    _run(first)  # the loop stops at step 2 (as a crash after its checkpoint would)
    trained = {k: v for b in first.group.engine.export_weights(1 << 30) for k, v in b}
    pub = InProcessPublisher(retain_versions=20)
    restarted = TrainerLoop(_settings(tmp_path, total_steps=3, **same), _group(), coord, pub, fake_algorithm()[0])
    _run(restarted)  # Serve restarts the replica: same config, same session
    assert coord.resumes == [0, 2] and not [p for p in root.iterdir() if ".abandoned-" in p.name]
    first_version = pub.get(min(pub.versions)).weights  # the restart's first publish: the trained weights
    assert all(torch.equal(first_version[k], trained[k]) for k in trained)
    # a new `meshrl train` (a new session) with disable starts over, as it always did
    _run(_loop(tmp_path, coord, total_steps=1, **{**same, "session": "s2"}))
    assert coord.resumes[-1] == 0 and [p for p in root.iterdir() if ".abandoned-" in p.name]


def test_rotation_never_deletes_the_checkpoint_just_reported(tmp_path: Path) -> None:
    """A checkpoint of a higher step from an earlier line of training (disable on a reused
    directory) outranked this run's in rotation, and the checkpoint just written and reported was
    deleted at once. It is set aside at the start instead, and the one just reported is protected."""
    root = tmp_path / "ckpt"
    old = root / "global_step_5"  # an earlier run's checkpoint
    old.mkdir(parents=True)
    (old / checkpoints.STATE_FILE).write_text(json.dumps({"step": 5, "policy_version": 5, "optimizer_steps": 5}))
    coord = FakeCoordinator(finite=False)
    _fill(coord, 4)
    loop = _loop(tmp_path, coord, resume_mode="disable", save_freq=1, total_steps=1, max_checkpoints_to_keep=1)
    _run(loop)
    step, _, path = coord.checkpoints[-1]
    assert step == 1
    assert Path(path).is_dir(), f"the reported checkpoint {path} was deleted by rotation"
    assert Path(loop.last_checkpoint_path).is_dir()
    (aside,) = [p.name for p in root.iterdir() if ".abandoned-" in p.name]
    assert aside.startswith("global_step_5.abandoned-") and checkpoints.newest(root) == root / "global_step_1"


def test_rotation_keeps_the_protected_checkpoint_whatever_its_step(tmp_path: Path) -> None:
    for step in (1, 4, 9):
        checkpoints.final_dir(tmp_path, step).mkdir()
    assert checkpoints.rotate(tmp_path, 1, protect=tmp_path / "global_step_1") == [tmp_path / "global_step_4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "global_step_9"]


def test_a_rollback_sets_the_later_checkpoints_aside_once_and_auto_forgets_it(tmp_path: Path) -> None:
    """resume_path to step 1 of a run that reached step 3: 2 and 3 are another line of training
    now, renamed aside (kept); the new line's 2 and 3 are its own. A restart with the same path
    resumes at the new line's newest; a start in `auto` clears the mark, so a later resume_path to
    the same path goes back again."""
    coord = FakeCoordinator(finite=False)
    _fill(coord, 40)
    root = tmp_path / "ckpt"
    _run(_loop(tmp_path, coord, save_freq=1, total_steps=3))
    back = {"resume_mode": "resume_path", "resume_from_path": str(root / "global_step_1"), "save_freq": 1}
    _run(_loop(tmp_path, coord, total_steps=1, **back))  # went back to 1 and stopped there
    assert coord.resumes[-1] == 1
    names = sorted(p.name for p in root.iterdir())
    assert names[:1] == ["global_step_1"] and [n.split(".")[0] for n in names[1:3]] == ["global_step_2", "global_step_3"]
    assert all(".abandoned-" in n for n in names[1:3]) and checkpoints.newest(root) == root / "global_step_1"
    assert checkpoints.resumed_from(root) == checkpoints.ResumedFrom(str(root / "global_step_1"), 1)
    _run(_loop(tmp_path, coord, total_steps=2, **back))  # a restart: resumes at 1 (nothing newer yet)
    _run(_loop(tmp_path, coord, total_steps=3, **back))  # a restart: resumes at the new line's 2
    assert coord.resumes[-2:] == [1, 2]
    assert len([p for p in root.iterdir() if ".abandoned-" in p.name]) == 2  # nothing more set aside
    _run(_loop(tmp_path, coord, total_steps=3))  # auto: the newest (3) and the mark goes
    assert coord.resumes[-1] == 3 and checkpoints.resumed_from(root) is None
    _run(_loop(tmp_path, coord, total_steps=1, **back))  # goes back to 1 again
    assert coord.resumes[-1] == 1


class _DiesOnFirstReport(FakeCoordinator):
    died: bool = False

    async def report_checkpoint(self, trainer_id: str, step: int, policy_version: int, path: str) -> None:
        if not self.died:
            self.died = True
            raise RuntimeError("trainer killed between commit and ReportCheckpoint")
        await super().report_checkpoint(trainer_id, step, policy_version, path)


def test_a_checkpoint_committed_but_not_reported_is_reported_after_resume(tmp_path: Path) -> None:
    """A trainer killed between committing a checkpoint (newest() finds it) and reporting it resumes
    from it: it is reported then, else the coordinator held its groups delivered (payloads and all)
    and its checkpoint mark stayed at the older one."""
    coord = _DiesOnFirstReport(finite=False)
    _fill(coord, 8)
    with pytest.raises(RuntimeError, match="killed"):
        _run(_loop(tmp_path, coord, total_steps=2))  # the end-of-run checkpoint of step 2
    assert checkpoints.newest(tmp_path / "ckpt") == tmp_path / "ckpt" / "global_step_2"
    assert coord.checkpoints == []
    _run(_loop(tmp_path, coord, total_steps=2))  # restarted: resumes at 2 and finishes
    assert coord.resumes[-1] == 2
    assert [s for s, _, _ in coord.checkpoints] == [2], "the checkpoint the trainer resumed from was never reported"


def test_resume_without_optimizer_state_trains_at_the_scheduled_lr() -> None:
    """load_contents without `optimizer` (model + extra): the scheduler's position is restored,
    and so must the optimizer's lr be (it kept schedule step 0's: warmup's lr/2 here)."""
    import tempfile

    kw: dict[str, Any] = {
        "optim": {"lr": 1e-3, "lr_warmup_steps": 2, "lr_scheduler_type": "cosine", "min_lr_ratio": 0.1},
        "total_steps": 8,
    }
    batch = fixed_batch()
    a = build(make_spec(**kw))
    for _ in range(3):
        a.train_step(micro_batches_for(a.spec.actor, batch), nll_loss)  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as d:
        a.save_checkpoint(Path(d) / "c")
        want = a.train_step(micro_batches_for(a.spec.actor, batch), nll_loss).lr  # type: ignore[attr-defined]
        spec = make_spec(**kw)
        spec.actor.checkpoint = CheckpointContentsConfig(load_contents=["model", "extra"])
        b = build(spec)
        b.load_checkpoint(Path(d) / "c")
    assert b.step == 3
    got = b.train_step(micro_batches_for(b.spec.actor, batch), nll_loss).lr  # type: ignore[attr-defined]
    assert got == pytest.approx(want), f"first step after resume used lr {got}, the schedule says {want}"
