"""CoordinatorCore: budget, leases, submission, delivery, versions, ledger restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import load_config, max_required_samples, required_samples
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.coordinator.core import CoordinatorCore, LeaseLimit, SubmitStatus

from .coord_helpers import group_for, make_core


@pytest.mark.parametrize(
    ("mini_batch", "require_batches", "staleness", "trigger", "expected"),
    [
        (128, 1, 0.5, 1, 192),  # Qwen3-235B recipe
        (16, 1, 0.75, 2, 56),  # Qwen3-30B DAPO recipe
        (32, 4, 0.5, 4, 768),  # verl 7B 128-GPU run: 32*4 * 1.5 * 4
        (8, 1, 0.0, 1, 8),  # on-policy: exactly one mini-batch per version
        (10, 1, 0.1, 3, 33),  # int() truncates 33.000000000000004
        (7, 1, 0.3, 1, 9),  # 9.1 -> 9
    ],
)
def test_staleness_arithmetic(mini_batch: int, require_batches: int, staleness: float, trigger: int, expected: int) -> None:
    req = required_samples(mini_batch, require_batches)
    assert max_required_samples(req, staleness, trigger) == expected


def test_derive_from_config_matches_recipes() -> None:
    from services.common.config import derive

    c1 = load_config(None, [
        "actor_rollout_ref.actor.ppo_mini_batch_size=128", "async_training.staleness_threshold=0.5",
        "async_training.trigger_parameter_sync_step=1", "rollout.total_rollout_steps=204800", "rollout.n=16",
    ])
    d1 = derive(c1)
    assert (d1.max_required_samples, d1.total_train_steps) == (192, 1600)
    c2 = load_config(None, [
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "async_training.staleness_threshold=0.75",
        "async_training.trigger_parameter_sync_step=2", "rollout.total_rollout_steps=3200", "rollout.n=4",
    ])
    d2 = derive(c2)
    assert (d2.max_required_samples, d2.total_train_steps) == (56, 100)


def test_budget_limits_leases_and_commit_resets_it(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", mini_batch=4, staleness=0.5, trigger=1)  # max_required = 6
    grant = core.lease("r0", 10, now=0.0)
    assert len(grant.leases) == 6 and grant.limit is LeaseLimit.STALENESS_BUDGET
    assert core.lease("r0", 1, now=0.0).leases == []
    # Submit 4, fetch 4: the budget does not move until a commit.
    for lease in grant.leases[:4]:
        core.submit("r0", [group_for(lease.lease_id, lease.seq, 0)], now=1.0)
    batch = core.fetch("t", 1, 4, now=1.0)
    assert [g.seq for g in batch.groups] == [lease.seq for lease in grant.leases[:4]]
    assert core.lease("r0", 1, now=1.0).leases == []
    # Commit: budget := in flight (2) + queued (0) -> 4 more leases allowed.
    version, budget = core.commit_version(1, b"ref-x")
    assert (version, budget) == (1, 2)
    assert len(core.lease("r0", 10, now=2.0).leases) == 4


def test_on_policy_budget_is_one_batch(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", mini_batch=3, staleness=0.0, trigger=1)
    assert len(core.lease("r", 100, 0.0).leases) == 3


def test_submission_is_idempotent_and_ordered(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db")
    leases = core.lease("r", 3, 0.0).leases
    g = [group_for(lease.lease_id, lease.seq, 0) for lease in leases]
    assert core.submit("r", [g[2], g[0]], 1.0) == [SubmitStatus.ACCEPTED, SubmitStatus.ACCEPTED]
    assert core.submit("r", [g[0], g[1]], 1.0) == [SubmitStatus.DUPLICATE, SubmitStatus.ACCEPTED]
    batch = core.fetch("t", 1, 10, 1.0)
    assert [d.lease_id for d in batch.groups] == [leases[2].lease_id, leases[0].lease_id, leases[1].lease_id]
    assert core.status(1.0).totals.duplicates == 1


def test_bad_submissions_change_nothing(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db")
    (lease,) = core.lease("r", 1, 0.0).leases
    with pytest.raises(NotFound, match=r"groups\[1\]\.lease_id"):
        core.submit("r", [group_for(lease.lease_id, lease.seq, 0), group_for("nope", 1, 0)], 1.0)
    with pytest.raises(InvalidArgument, match="prompt_seq"):
        core.submit("r", [group_for(lease.lease_id, lease.seq + 1, 0)], 1.0)
    with pytest.raises(InvalidArgument, match="newer than the current policy version"):
        core.submit("r", [group_for(lease.lease_id, lease.seq, 3)], 1.0)
    assert core.in_flight == 1 and core.queued == 0
    assert core.submit("r", [group_for(lease.lease_id, lease.seq, 0)], 1.0) == [SubmitStatus.ACCEPTED]


def test_expired_lease_is_reissued_and_late_submit_is_handled(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", lease_timeout_s=10.0)
    a, b = core.lease("dead", 2, 0.0).leases
    assert core.expire(11.0) == 2
    assert core.in_flight == 0 and core.status(11.0).retry_pending == 2
    # A late answer for `a` is still welcome: its prompt was not re-issued yet.
    assert core.submit("dead", [group_for(a.lease_id, a.seq, 0)], 12.0) == [SubmitStatus.ACCEPTED]
    # `b`'s prompt is re-issued to another replica before the late answer comes.
    (b2,) = core.lease("alive", 1, 12.0).leases
    assert b2.seq == b.seq
    assert core.submit("dead", [group_for(b.lease_id, b.seq, 0)], 13.0) == [SubmitStatus.EXPIRED]
    assert core.submit("alive", [group_for(b2.lease_id, b2.seq, 0)], 13.0) == [SubmitStatus.ACCEPTED]
    assert sorted(g.seq for g in core.fetch("t", 1, 10, 14.0).groups) == sorted([a.seq, b.seq])
    assert core.audit()["balanced"]


def test_renew_keeps_lease_alive(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", lease_timeout_s=10.0)
    (lease,) = core.lease("r", 1, 0.0).leases
    renewed, lost, deadline = core.renew("r", [lease.lease_id, "gone"], 8.0)
    assert renewed == [lease.lease_id] and lost == ["gone"] and deadline == 18.0
    assert core.expire(15.0) == 0
    assert core.expire(18.0) == 1


def test_a_lease_renewed_to_the_deadline_it_already_has_expires_once(tmp_path: Path) -> None:
    """A renewal at the same clock reading as the grant (or as an earlier renewal) gives the
    deadline the lease already has: a second heap entry equal to the first. Both pop at the
    deadline; the lease must expire once (it went into the retry table twice: a UNIQUE error
    that failed this and every later expire, so every call that expires first, for good)."""
    core = make_core(tmp_path / "l.db", lease_timeout_s=10.0)
    (lease,) = core.lease("r", 1, 0.0).leases
    assert core.renew("r", [lease.lease_id], 0.0)[2] == lease.deadline
    assert core.expire(10.0) == 1
    st = core.status(10.0)
    assert (st.in_flight, st.retry_pending, st.totals.leases_expired) == (0, 1, 1)
    (again,) = core.lease("r2", 1, 11.0).leases
    assert again.seq == lease.seq
    assert core.audit()["balanced"]


def test_the_expiry_heap_stays_bounded_under_frequent_renewals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each renewal leaves its older heap entry to pop at its old deadline: with renewals far more
    frequent than the lease timeout the heap would hold timeout/interval entries per lease. It is
    rebuilt from the live leases, and expiry is unchanged by that."""
    monkeypatch.setattr("services.coordinator.core.COMPACT_SLACK", 8)
    core = make_core(tmp_path / "l.db", lease_timeout_s=1000.0, staleness=1.0)
    leases = core.lease("r", 4, 0.0).leases
    ids = [lease.lease_id for lease in leases]
    for k in range(1, 200):
        core.renew("r", ids, float(k))
        assert len(core._deadlines) <= 2 * len(ids) + 8 + 1
    assert core.expire(1198.0) == 0
    core.submit("r", [group_for(leases[0].lease_id, leases[0].seq, 0)], 1198.0)  # finished: never expires
    assert core.expire(1199.0) == 3
    assert core.audit()["balanced"]


def test_return_leases_requeues_prompts_first(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", staleness=1.0)
    leases = core.lease("r", 3, 0.0).leases
    assert core.return_leases("r", [leases[1].lease_id, leases[1].lease_id, "unknown"], 1.0) == 1
    (again,) = core.lease("r2", 1, 1.0).leases
    assert again.seq == leases[1].seq


def test_a_return_and_a_submit_that_cross_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    """A replica's ReturnLeases and SubmitGroups for one lease can cross (a drain racing a batched
    submit). In either order the prompt is trained once: a return after the submit is ignored; a
    submit after the return is a late answer, judged per group like one for an expired lease
    (accepted while the prompt waits for re-issue, EXPIRED once it was re-issued), also after a
    restart, and never fails the other groups of its call."""
    core = make_core(tmp_path / "l.db", staleness=1.0)
    a, b, c, d, e = core.lease("r", 5, 0.0).leases
    assert core.submit("r", [group_for(a.lease_id, a.seq, 0)], 1.0) == [SubmitStatus.ACCEPTED]
    assert core.return_leases("r", [a.lease_id], 1.0) == 0
    assert core.return_leases("r", [b.lease_id, d.lease_id, e.lease_id], 2.0) == 3
    statuses = core.submit("r", [group_for(c.lease_id, c.seq, 0), group_for(b.lease_id, b.seq, 0)], 3.0)
    assert statuses == [SubmitStatus.ACCEPTED, SubmitStatus.ACCEPTED]
    (d2, e2) = core.lease("r2", 2, 4.0).leases  # b's prompt no longer waits: only d's and e's
    assert (d2.seq, e2.seq) == (d.seq, e.seq)
    assert core.submit("r", [group_for(d.lease_id, d.seq, 0)], 5.0) == [SubmitStatus.EXPIRED]
    assert core.return_leases("r2", [e2.lease_id], 5.0) == 1
    core.ledger.close()
    core = make_core(tmp_path / "l.db", staleness=1.0)
    assert core.submit("r", [group_for(d.lease_id, d.seq, 0)], 6.0) == [SubmitStatus.EXPIRED]
    # e's prompt waits for re-issue again (e2 was returned): either late answer may take it, once
    assert core.submit("r", [group_for(e.lease_id, e.seq, 0)], 6.0) == [SubmitStatus.ACCEPTED]
    assert core.submit("r2", [group_for(e2.lease_id, e2.seq, 0)], 6.0) == [SubmitStatus.EXPIRED]
    assert core.submit("r2", [group_for(d2.lease_id, d2.seq, 0)], 6.0) == [SubmitStatus.ACCEPTED]
    assert core.submit("r", [group_for(b.lease_id, b.seq, 0)], 7.0) == [SubmitStatus.DUPLICATE]
    seqs = [g.seq for g in core.fetch("t", 1, 10, 7.0).groups]
    assert sorted(seqs) == sorted(x.seq for x in (a, b, c, d, e))
    status = core.status(7.0)
    assert status.in_flight == status.queued == status.retry_pending == 0
    assert status.totals.late_accepted == 2
    assert core.audit()["balanced"]


def test_max_staleness_versions_regenerates_instead_of_dropping(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", mini_batch=2, staleness=1.0, trigger=1, eta=1)
    old = core.lease("r", 2, 0.0).leases
    for lease in old:
        core.submit("r", [group_for(lease.lease_id, lease.seq, 0)], 0.0)
    core.commit_version(1, b"")
    core.commit_version(2, b"")
    batch = core.fetch("t", 1, 2, 1.0)
    assert batch.groups == [] and batch.regenerated == 2
    st = core.status(1.0)
    assert st.totals.regenerated == 2 and st.retry_pending == 2
    again = core.lease("r", 2, 1.0).leases
    assert sorted(lease.seq for lease in again) == sorted(lease.seq for lease in old)
    for lease in again:
        core.submit("r", [group_for(lease.lease_id, lease.seq, 2)], 2.0)
    batch = core.fetch("t", 1, 2, 2.0)
    assert [g.staleness for g in batch.groups] == [0, 0]
    assert core.audit()["balanced"]


def test_commit_version_must_advance_by_one(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db")
    core.commit_version(1, b"a1")
    assert core.commit_version(1, b"a1") == (1, 0)  # replay of the same commit: no-op
    with pytest.raises(FailedPrecondition, match="must be 2"):
        core.commit_version(3, b"")
    with pytest.raises(FailedPrecondition):
        core.commit_version(1, b"a2")


def test_restart_continues_exactly(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    core = make_core(db, staleness=1.0)
    leases = core.lease("r", 5, 0.0).leases
    core.submit("r", [group_for(leases[0].lease_id, leases[0].seq, 0), group_for(leases[1].lease_id, leases[1].seq, 0)], 1.0)
    core.fetch("t", 1, 1, 1.0)
    core.commit_version(1, b"ref-ps1")
    core.set_staleness(0.25)
    before = core.status(2.0)
    core.ledger.close()

    again = make_core(db, staleness=1.0)
    after = again.status(2.0)
    assert after.run_id == before.run_id
    assert (after.policy_version, after.in_flight, after.queued, after.budget_used) == (1, 3, 1, before.budget_used)
    assert after.staleness_threshold == 0.25 and after.totals == before.totals
    # The queued group and the in-flight leases survived; a duplicate submit is still detected.
    assert again.submit("r", [group_for(leases[0].lease_id, leases[0].seq, 0)], 3.0) == [SubmitStatus.DUPLICATE]
    assert again.submit("r", [group_for(leases[2].lease_id, leases[2].seq, 0)], 3.0) == [SubmitStatus.ACCEPTED]
    assert [g.seq for g in again.fetch("t", 2, 5, 3.0).groups] == [leases[1].seq, leases[2].seq]
    # New leases continue the cursor, never re-issue.
    seqs = {lease.seq for lease in again.lease("r", 2, 4.0).leases}
    assert seqs.isdisjoint({lease.seq for lease in leases})
    assert again.audit()["balanced"]


def test_ledger_from_another_run_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    make_core(db, total=40).ledger.close()
    with pytest.raises(FailedPrecondition, match=r"new coordinator\.ledger_path"):
        make_core(db, total=41)


def test_trainer_resume_requeues_groups_after_checkpoint(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", mini_batch=2, staleness=3.0)
    leases = core.lease("r", 6, 0.0).leases
    core.submit("r", [group_for(lease.lease_id, lease.seq, 0) for lease in leases], 1.0)
    s1 = [g.seq for g in core.fetch("t", 1, 2, 1.0).groups]
    core.report_checkpoint(1, 0, "/ckpt/1")
    s2 = [g.seq for g in core.fetch("t", 2, 2, 1.0).groups]
    assert core.status(1.0).totals.consumed == 4
    assert core.resume_trainer(1) == 2
    assert core.status(1.0).totals.consumed == 2
    # Step 2's groups come back first, in order, then the rest.
    after = [g.seq for g in core.fetch("t", 2, 4, 2.0).groups]
    assert after[:2] == s2 and set(after).isdisjoint(s1)
    assert core.audit()["balanced"]


@pytest.mark.parametrize("case", ["requeued", "payload_dropped", "rolled_back"])
def test_groups_a_resumed_trainer_sends_back_are_counted_once_in_the_budget(tmp_path: Path, case: str) -> None:
    """ResumeTrainer (a trainer restart, or its re-sync after a FetchBatch lost to a coordinator
    restart) in the window the groups were delivered in: the count still holds their units. A
    group back in the queue took a second unit, and a prompt sent back to retry kept its unit:
    with the budget used up (rollouts lease all they may) the rollouts were refused for good, so a
    trainer still short of groups (DAPO drops, or the prompts in retry) waited forever."""
    core = make_core(tmp_path / "l.db", mini_batch=2, staleness=0.0, keep_delivered_payloads=case != "payload_dropped")
    _fill(core, 2, 0)  # max_required = 2: used up
    core.fetch("t", 1, 2, 1.0)
    if case == "rolled_back":
        core.report_checkpoint(1, 0, "/ckpt/1")
    assert core.resume_trainer(0) == (0 if case == "rolled_back" else 2)
    assert core.status(1.0).budget_used == core.in_flight + core.queued == (2 if case == "requeued" else 0)
    if case == "requeued":
        dropped = core.fetch("t", 1, 2, 2.0).groups[0].lease_id  # DAPO drops one: one more is needed
        core.fetch("t", 1, 1, 2.0, filtered=[dropped])
        assert len(core.lease("r", 2, 2.0).leases) == 1
    else:
        assert len(core.lease("r", 2, 2.0).leases) == 2  # the two prompts, issued again
    assert core.audit()["balanced"]


def test_a_trainer_resumed_from_an_older_checkpoint_gets_the_steps_after_it_again(tmp_path: Path) -> None:
    """A rollback (resume_path to an older checkpoint, or the newest one gone): the groups that a
    later checkpoint consumed were never trained into the weights now loaded; their prompts are
    issued again (the payloads were dropped at that checkpoint), and the trainer's next
    checkpoint is taken, not refused as older than the last one. Also after a restart."""
    db = tmp_path / "l.db"
    core = make_core(db, mini_batch=2, staleness=3.0)
    leases = core.lease("r", 8, 0.0).leases
    core.submit("r", [group_for(lease.lease_id, lease.seq, 0) for lease in leases], 1.0)
    core.fetch("t", 1, 2, 1.0)
    core.report_checkpoint(1, 0, "/ckpt/1")
    later = [g.seq for step in (2, 3) for g in core.fetch("t", step, 2, 1.0).groups]
    core.report_checkpoint(3, 0, "/ckpt/3")
    assert core.status(1.0).totals.consumed == 6
    assert core.resume_trainer(1) == 0  # nothing delivered after step 3 to put back
    st = core.status(1.0)
    assert st.totals.consumed == 2 and st.totals.regenerated == 4 and st.last_checkpoint_step == 1
    assert core.audit()["balanced"]
    core.ledger.close()
    core = make_core(db, mini_batch=2, staleness=3.0)
    core.commit_version(1, b"1")  # the budget of the prompts issued again
    again = core.lease("r", 8, 2.0).leases
    assert sorted(lease.seq for lease in again[:4]) == sorted(later)  # re-issued first
    core.submit("r", [group_for(lease.lease_id, lease.seq, 1) for lease in again], 3.0)
    core.fetch("t", 2, 2, 3.0)
    core.report_checkpoint(2, 0, "/ckpt/2b")  # was refused: "older than the last checkpoint step 3"
    assert core.audit()["balanced"]


def test_filtered_groups_give_budget_back(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", mini_batch=2, staleness=0.0)
    leases = core.lease("r", 5, 0.0).leases
    assert len(leases) == 2
    core.submit("r", [group_for(lease.lease_id, lease.seq, 0) for lease in leases], 1.0)
    batch = core.fetch("t", 1, 2, 1.0)
    core.fetch("t", 1, 1, 1.0, filtered=[batch.groups[0].lease_id])
    st = core.status(1.0)
    assert st.totals.filtered == 1 and st.totals.consumed == 1
    assert len(core.lease("r", 5, 1.0).leases) == 1  # one unit came back
    with pytest.raises(NotFound):
        core.fetch("t", 1, 1, 1.0, filtered=["never-submitted"])


def test_groups_filtered_after_their_checkpoint_count_as_filtered_and_give_budget_back(tmp_path: Path) -> None:
    """The trainer reports its filter at the next fetch, after the checkpoint of that step consumed
    the group: still filtered (not trained), its budget unit back, once only (a resent fetch)."""
    core = make_core(tmp_path / "l.db", mini_batch=2, staleness=0.0)
    leases = core.lease("r", 5, 0.0).leases
    core.submit("r", [group_for(lease.lease_id, lease.seq, 0) for lease in leases], 1.0)
    batch = core.fetch("t", 1, 2, 1.0)
    core.report_checkpoint(1, 0, "/ckpt/1")
    assert core.status(1.0).totals.consumed == 2
    dropped = batch.groups[0].lease_id
    core.fetch("t", 2, 1, 1.0, filtered=[dropped])
    core.fetch("t", 2, 1, 1.0, filtered=[dropped])  # its reply lost, sent again
    st = core.status(1.0)
    assert st.totals.filtered == 1 and st.totals.consumed == 1
    assert sum(st.histogram.values()) == 1
    assert len(core.lease("r", 5, 1.0).leases) == 1  # one unit came back
    assert core.audit()["balanced"]
    core.ledger.close()
    again = make_core(tmp_path / "l.db", mini_batch=2, staleness=0.0)  # the ledger holds the same
    st = again.status(1.0)
    assert st.totals.filtered == 1 and st.totals.consumed == 1
    assert again.audit()["balanced"]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_group_filtered_after_the_commit_gives_back_no_unit_the_commit_already_took(
    tmp_path: Path, checkpointed: bool
) -> None:
    """The trainer reports the groups it dropped in a step's last fetch at the next step's first
    fetch, after CommitVersion (trainer_service.overlap off). The commit reset the budget to
    in_flight + queued, which no longer counted them: giving their unit back again let more
    prompts be leased in the new version's window than max_required_samples."""
    core = make_core(tmp_path / "l.db", mini_batch=2, staleness=0.0)  # max_required = 2
    _fill(core, 2, 0)
    dropped = core.fetch("t", 1, 2, 1.0).groups[0].lease_id  # step 1's last fetch; one group dropped
    if checkpointed:
        core.report_checkpoint(1, 0, "/ckpt/1")
    assert core.commit_version(1, b"")[1] == 0
    _fill(core, 2, 1, now=2.0)  # the new window's two prompts: the budget is used up
    assert core.lease("r", 1, 2.0).limit is LeaseLimit.STALENESS_BUDGET
    assert len(core.fetch("t", 2, 2, 3.0, filtered=[dropped]).groups) == 2
    st = core.status(3.0)
    assert st.totals.filtered == 1 and st.budget_used == 2
    assert core.lease("r", 1, 3.0).leases == []  # was granted: a third prompt in a window of two
    assert core.audit()["balanced"]


def test_pause_and_stop(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db")
    core.set_paused(True)
    assert core.lease("r", 1, 0.0).limit is LeaseLimit.PAUSED
    core.set_paused(False)
    assert core.lease("r", 1, 0.0).leases
    core.stop()
    grant = core.lease("r", 1, 0.0)
    assert grant.limit is LeaseLimit.STOPPING and not grant.leases
    assert core.fetch("t", 1, 1, 0.0).stop_requested


def test_stop_belongs_to_its_session(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    core = make_core(db, session="a")
    core.stop()
    core.ledger.close()
    # A restarted replica of the same session keeps the pending stop...
    again = make_core(db, session="a")
    assert again.stopping and again.lease("r", 1, 0.0).limit is LeaseLimit.STOPPING
    again.ledger.close()
    # ...a new session continuing the ledger (`meshrl train --resume`) starts un-stopped.
    resumed = make_core(db, session="b")
    assert not resumed.stopping and resumed.lease("r", 1, 0.0).leases
    resumed.ledger.close()
    assert not make_core(db, session="b").stopping


def test_run_exhausts_after_total_prompts(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", mini_batch=4, staleness=10.0, total=5, dataset_size=3)
    leases = core.lease("r", 100, 0.0).leases
    assert len(leases) == 5
    assert core.lease("r", 1, 0.0).limit is LeaseLimit.EXHAUSTED
    # 5 prompts over a 3-row dataset: two epochs, each row at most twice.
    ids = [lease.prompt.prompt_id for lease in leases]
    assert len(set(ids[:3])) == 3 and set(ids[3:]) <= set(ids[:3])
    core.submit("r", [group_for(lease.lease_id, lease.seq, 0) for lease in leases], 1.0)
    batch = core.fetch("t", 1, 5, 1.0)
    assert len(batch.groups) == 5 and batch.exhausted


def test_refused_late_answer_stays_refused(tmp_path: Path) -> None:
    """Found by the property test: a late answer refused as EXPIRED must not be accepted on a
    retry after the prompt, re-issued in between, came back to the retry queue."""
    core = make_core(tmp_path / "l.db", lease_timeout_s=10.0, staleness=1.0)
    (a,) = core.lease("dead", 1, 0.0).leases
    core.expire(11.0)
    (b,) = core.lease("other", 1, 11.0).leases  # re-issued
    assert core.submit("dead", [group_for(a.lease_id, a.seq, 0)], 12.0) == [SubmitStatus.EXPIRED]
    core.return_leases("other", [b.lease_id], 13.0)  # the prompt waits for re-issue again
    assert core.submit("dead", [group_for(a.lease_id, a.seq, 0)], 14.0) == [SubmitStatus.EXPIRED]
    core.ledger.close()
    again = make_core(tmp_path / "l.db", lease_timeout_s=10.0, staleness=1.0)
    assert again.submit("dead", [group_for(a.lease_id, a.seq, 0)], 15.0) == [SubmitStatus.EXPIRED]
    assert again.audit()["balanced"]


def _fill(core: CoordinatorCore, n: int, version: int, now: float = 0.0) -> None:
    leases = core.lease("r", n, now).leases
    core.submit("r", [group_for(lease.lease_id, lease.seq, version) for lease in leases], now)


def test_fetching_ahead_leaves_budget_and_staleness_as_fetching_after_the_commit(tmp_path: Path) -> None:
    """A trainer that fetches step 2's groups (train_version=1) while version 1 is still being
    published gets the staleness they will be trained at, and the rollouts get the budget they would
    have had if it had fetched after the commit."""
    outcomes = []
    for ahead in (False, True):
        core = make_core(tmp_path / f"{ahead}.db", mini_batch=4, staleness=1.0, trigger=1)  # max_required = 8
        _fill(core, 8, 0)
        assert [g.staleness for g in core.fetch("t", 1, 4, 1.0, train_version=0).groups] == [0] * 4
        if ahead:
            second = core.fetch("t", 2, 4, 1.0, train_version=1)
            budget = core.commit_version(1, b"")[1]
        else:
            budget = core.commit_version(1, b"")[1]
            second = core.fetch("t", 2, 4, 1.0)
        granted = len(core.lease("r", 100, 2.0).leases)
        outcomes.append(([g.staleness for g in second.groups], budget, granted))
        assert core.audit()["balanced"]
    assert outcomes[0] == outcomes[1] == ([1, 1, 1, 1], 4, 4)


def test_a_checkpoint_of_groups_fetched_ahead_waits_for_their_version(tmp_path: Path) -> None:
    """Groups fetched ahead (train_version=1) hold units of the window after version 1 commits; a
    checkpoint holding them before that commit is refused with nothing changed (it consumed them
    and the commit's window granted 8 leases where the rule allows 4), and taken after it."""
    core = make_core(tmp_path / "l.db", mini_batch=4, staleness=1.0, trigger=1)  # max_required = 8
    _fill(core, 8, 0)
    core.fetch("t", 1, 4, 1.0, train_version=0)
    core.fetch("t", 2, 4, 1.0, train_version=1)
    before = core.status(1.0)
    with pytest.raises(FailedPrecondition, match=r"version 1, which is not committed.*CommitVersion\(1\)"):
        core.report_checkpoint(2, 0, "/ckpt/2")
    after = core.status(1.0)
    assert (after.last_checkpoint_step, after.budget_used, after.totals) == (
        before.last_checkpoint_step, before.budget_used, before.totals)
    core.report_checkpoint(1, 0, "/ckpt/1")  # the step trained at the committed version is fine
    assert core.commit_version(1, b"")[1] == 4
    core.report_checkpoint(2, 1, "/ckpt/2")
    assert len(core.lease("r", 100, 2.0).leases) == 4
    assert core.audit()["balanced"]


def test_train_version_must_be_current_or_next(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", mini_batch=2, staleness=1.0)
    _fill(core, 2, 0)
    for bad in (2, -1):
        with pytest.raises(FailedPrecondition, match=f"train_version {bad}.*current version \\(0\\)"):
            core.fetch("t", 1, 2, 1.0, train_version=bad)
    core.commit_version(1, b"")
    with pytest.raises(FailedPrecondition, match="train_version 0"):
        core.check_train_version(0)
    assert core.queued == 2 and core.audit()["balanced"]  # a refused fetch took nothing


def test_max_staleness_is_measured_at_the_train_version(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", mini_batch=2, staleness=2.0, trigger=1, eta=1)
    _fill(core, 2, 0)
    core.commit_version(1, b"")
    # Trained at version 1 they would be 1 stale (allowed); fetched to train at 2 they are too stale.
    batch = core.fetch("t", 1, 2, 1.0, train_version=2)
    assert batch.groups == [] and batch.regenerated == 2
    assert core.audit()["balanced"]


def test_groups_fetched_ahead_survive_a_coordinator_restart_in_the_budget(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    core = make_core(db, mini_batch=4, staleness=1.0, trigger=1)
    _fill(core, 8, 0)
    core.fetch("t", 1, 4, 1.0)
    core.fetch("t", 2, 4, 1.0, train_version=1)
    core.ledger.close()
    again = make_core(db, mini_batch=4, staleness=1.0, trigger=1)
    assert again.commit_version(1, b"")[1] == 4  # the 4 groups fetched ahead still count
    assert len(again.lease("r", 100, 2.0).leases) == 4


def test_filtered_or_requeued_groups_fetched_ahead_leave_the_budget(tmp_path: Path) -> None:
    core = make_core(tmp_path / "l.db", mini_batch=2, staleness=3.0, trigger=1)
    _fill(core, 6, 0)
    core.fetch("t", 1, 2, 1.0)
    core.report_checkpoint(1, 0, "/ckpt/1")
    ahead = core.fetch("t", 2, 2, 1.0, train_version=1)
    # The trainer drops one group fetched ahead (DAPO) and then restarts from step 1: the other
    # goes back to the queue. Neither is counted as fetched ahead any more.
    core.fetch("t", 2, 1, 1.0, train_version=1, filtered=[ahead.groups[0].lease_id])
    assert core.resume_trainer(1) == 2
    assert core.commit_version(1, b"")[1] == core.in_flight + core.queued
    assert core.audit()["balanced"]


def test_a_ledger_written_with_weights_as_a_dict_still_opens(tmp_path: Path) -> None:
    """Ledgers from before the WeightsRef was stored in wire form held it as a dict."""
    import json
    import sqlite3

    from meshrl.v1 import common_pb2

    db = tmp_path / "l.db"
    core = make_core(db)
    core.commit_version(1, common_pb2.WeightsRef(policy_version=1).SerializeToString())
    core.ledger.close()
    conn = sqlite3.connect(db)
    state = json.loads(conn.execute("SELECT json FROM run_state").fetchone()[0])
    state["weights"] = {"policy_version": 1, "param_server_address": "ps:9", "manifest_checksum": "ab", "total_bytes": 7}
    conn.execute("UPDATE run_state SET json = ?", (json.dumps(state),))
    conn.commit()
    conn.close()
    version, ref = make_core(db).announced()
    assert version == 1
    assert common_pb2.WeightsRef.FromString(ref) == common_pb2.WeightsRef(
        policy_version=1, param_server_address="ps:9", manifest_checksum="ab", total_bytes=7
    )


def test_a_prompt_that_keeps_failing_where_others_go_through_is_set_aside(tmp_path: Path) -> None:
    """A failed group's prompt is re-issued at once, so one that always fails (a template it breaks,
    data a tool cannot take) came back for as long as the run lasted (a lease, a failure and a
    ledger row each time; the consecutive-failure halt never came, the other prompts went through).
    After max_prompt_failures failures, each on a replica that had a group accepted since its own
    last failure, it is set aside: never leased again, counted, and accounted for by the audit;
    the run can end."""
    core = make_core(tmp_path / "l.db", mini_batch=4, staleness=10.0, total=7, max_prompt_failures=3)
    first, poison, *good = core.lease("r", 7, 0.0).leases
    assert core.submit("r", [group_for(first.lease_id, first.seq, 0)], 0.0) == [SubmitStatus.ACCEPTED]
    now = 1.0
    for i in range(3):
        assert core.return_leases("r", [poison.lease_id], now, error="chat template: cannot render") == 1
        if i < 2:
            (poison,) = core.lease("r", 1, now).leases  # back at once, first in line
            ok = good.pop()
            assert core.submit("r", [group_for(ok.lease_id, ok.seq, 0)], now) == [SubmitStatus.ACCEPTED]
        now += 1
    assert core.lease("r", 1, now).limit is LeaseLimit.EXHAUSTED  # nothing left to issue: set aside
    assert core.status(now).totals.prompts_set_aside == 1 and core.status(now).retry_pending == 0
    # a late answer for its old lease is refused (it no longer waits for re-issue)
    assert core.submit("r", [group_for(poison.lease_id, poison.seq, 0)], now) == [SubmitStatus.EXPIRED]
    core.submit("r", [group_for(x.lease_id, x.seq, 0) for x in good], now)
    assert len(core.fetch("t", 1, 10, now).groups) == 6
    audit = core.audit()
    assert audit["balanced"] and audit["set_aside"] == 1 and audit["issued"] == 7, audit
    assert core.exhausted
    core.ledger.close()
    again = make_core(tmp_path / "l.db", mini_batch=4, staleness=10.0, total=7, max_prompt_failures=3)
    assert again.status(now).totals.prompts_set_aside == 1 and again.audit()["set_aside"] == 1
    assert again.lease("r", 1, now).limit is LeaseLimit.EXHAUSTED
    assert again.ledger.set_aside_rows() == [(poison.seq, 3, "chat template: cannot render")]


def test_a_replica_or_an_outage_that_fails_everything_sets_no_prompt_aside(tmp_path: Path) -> None:
    """A replica whose engine or endpoint fails every group gets the prompt it just failed back at
    once, while the other replicas' groups go through (no consecutive-failure halt): counted per
    re-issue, that set good prompts aside for good. A failure counts only on a replica that had a
    group accepted since its own last failure; an outage (everything fails) is
    max_consecutive_failures' case. Counts end when a group of the prompt is accepted."""
    core = make_core(tmp_path / "l.db", mini_batch=4, staleness=10.0, total=100, max_prompt_failures=2,
                     max_consecutive_failures=500)
    now = 0.0
    for _ in range(20):  # "bad" fails all it takes, "good" submits all it takes
        for x in core.lease("bad", 2, now).leases:
            core.return_leases("bad", [x.lease_id], now, error="engine: CUDA error")
        (g,) = core.lease("good", 1, now).leases or [None]
        if g is not None:
            core.submit("good", [group_for(g.lease_id, g.seq, 0)], now)
        now += 1
    assert core.status(now).totals.prompts_set_aside == 0
    # a replica that works fails one prompt twice: that prompt is set aside; its counts survive
    # a restart, and a prompt whose group is accepted in between starts over
    core.ledger.close()
    core = make_core(tmp_path / "l.db", mini_batch=4, staleness=10.0, total=100, max_prompt_failures=2,
                     max_consecutive_failures=500)
    a, b, c = core.lease("good", 3, now).leases
    core.submit("good", [group_for(c.lease_id, c.seq, 0)], now)
    core.return_leases("good", [a.lease_id, b.lease_id], now, error="tool crashed")
    assert core.status(now).totals.prompts_set_aside == 0
    a2, b2 = core.lease("good", 2, now).leases
    assert (a2.seq, b2.seq) == (a.seq, b.seq)
    core.submit("good", [group_for(b2.lease_id, b2.seq, 0)], now)  # b went through: its count ends
    core.return_leases("good", [a2.lease_id], now, error="tool crashed")
    assert core.status(now).totals.prompts_set_aside == 1 and core.ledger.set_aside_rows()[0][0] == a.seq
    # a drain's return (no error) never counts
    d, *_ = core.lease("good", 1, now).leases
    assert core.return_leases("good", [d.lease_id], now) == 1 and core.status(now).totals.prompts_set_aside == 1
    assert core.audit()["balanced"]
    assert core._prompt_failures == {}


def test_ended_leases_are_looked_up_in_the_ledger_not_kept_in_memory(tmp_path: Path) -> None:
    """Every lease that ever ended was kept in memory (submitted ids, expired or returned ids and
    their seqs, refused ids): ~110 MiB per million prompts, all read back at every restart. The
    ledger answers for them by primary key: a repeat is still DUPLICATE, a late answer still judged
    by its prompt, after a restart too, and memory holds only what is live."""
    core = make_core(tmp_path / "l.db", mini_batch=64, staleness=4.0, total=300, dataset_size=16)
    leases = core.lease("r", 300, 0.0).leases
    core.return_leases("r", [leases[0].lease_id], 1.0)
    core.submit("r", [group_for(x.lease_id, x.seq, 0) for x in leases[1:]], 1.0)
    core.fetch("t", 1, 300, 1.0)
    core.ledger.close()
    core = make_core(tmp_path / "l.db", mini_batch=64, staleness=4.0, total=300, dataset_size=16)
    # (the 299 delivered groups are live until a checkpoint of their step: not counted here)
    sizes = {k: len(v) for k, v in vars(core).items() if isinstance(v, dict | set | list) and k != "_delivered"}
    assert max(sizes.values()) < 50, sizes
    old = leases[5]
    assert core.submit("r", [group_for(old.lease_id, old.seq, 0)], 2.0) == [SubmitStatus.DUPLICATE]
    # the returned lease's prompt still waits: its late answer is taken (for its own prompt), once
    with pytest.raises(InvalidArgument, match="is for prompt"):
        core.submit("r", [group_for(leases[0].lease_id, leases[8].seq, 0)], 2.0)
    assert core.submit("r", [group_for(leases[0].lease_id, leases[0].seq, 0)], 2.0) == [SubmitStatus.ACCEPTED]
    assert core.submit("r", [group_for(leases[0].lease_id, leases[0].seq, 0)], 2.0) == [SubmitStatus.DUPLICATE]
    with pytest.raises(NotFound):
        core.submit("r", [group_for("no-such-lease", 1, 0)], 2.0)
    assert core.audit()["balanced"]


def test_delivered_groups_keep_their_payload_in_the_ledger_only_and_a_resume_queues_them_again(tmp_path: Path) -> None:
    """Until a checkpoint, a delivered group's payload is kept for ResumeTrainer. It was kept in
    the coordinator's memory as well as the ledger, and read back into memory on a restart: a run
    without checkpoints (the default save_freq=-1) held every group it trained, and a coordinator
    that died of it died again on restart. The bytes now stay in the ledger; a resume (after a
    restart too) queues the same bytes again, in order."""
    path = tmp_path / "l.db"
    core = make_core(path, mini_batch=4, staleness=1.0)
    grant = core.lease("r", 4, 0.0)
    sent = [group_for(x.lease_id, x.seq, 0) for x in grant.leases]
    core.submit("r", sent, 0.0)
    batch = core.fetch("t", 1, 4, 0.0, [], None)
    assert [g.payload for g in batch.groups] == [g.payload for g in sent]
    assert all(d.has_payload for d in core._delivered.values())
    assert not any(isinstance(v, bytes) for d in core._delivered.values() for v in vars(d).values()), \
        "a delivered group's bytes are held in memory"
    core.ledger.close()

    restarted = make_core(path, mini_batch=4, staleness=1.0)
    assert not any(isinstance(v, bytes) for d in restarted._delivered.values() for v in vars(d).values())
    assert restarted.resume_trainer(0) == 4
    again = restarted.fetch("t", 1, 4, 0.0, [], None)
    assert [(g.lease_id, g.payload) for g in again.groups] == [(g.lease_id, g.payload) for g in sent]
    assert restarted.audit()["balanced"]


def test_a_staleness_threshold_changed_in_the_config_applies_on_resume(tmp_path: Path) -> None:
    """`meshrl train --resume RUN_DIR async_training.staleness_threshold=...` (or `--mode sync`,
    which sets it to 0): the ledger's value stayed, so the budget went on at the first run's
    threshold while the config, the report and trigger_parameter_sync_step (read from the config)
    said otherwise. A value set live (SetStaleness) survives a restart on the same config."""
    db = tmp_path / "l.db"
    core = make_core(db, staleness=0.5)
    core.set_staleness(0.25)
    core.ledger.close()
    again = make_core(db, staleness=0.5)  # Serve restarted the coordinator: same config
    assert again.status(0.0).staleness_threshold == 0.25
    again.ledger.close()
    resumed = make_core(db, staleness=0.0)  # resumed with another threshold
    assert resumed.status(0.0).staleness_threshold == 0.0
    assert resumed.max_required_samples == 4
    resumed.set_staleness(2.0)
    resumed.ledger.close()
    assert make_core(db, staleness=0.0).status(0.0).staleness_threshold == 2.0
