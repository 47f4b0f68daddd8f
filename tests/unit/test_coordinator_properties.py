"""Property-based: random interleavings of lease, renew (also at the clock reading of the grant),
expire, submit (with duplicates and late answers), return (crossing submits of the same lease
either way), fetch (also ahead, for the next version), filter (also after a commit or a
checkpoint), commit, checkpoint, trainer resume and coordinator restart never lose or duplicate a
prompt, never grant a lease beyond the staleness budget, and keep the budget's count exactly at
in_flight + queued + the delivered groups it still holds (module docstring of core.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.common.errors import FailedPrecondition
from services.coordinator.core import SubmitStatus

from .coord_helpers import group_for, make_core

PARAMS = {"mini_batch": 3, "staleness": 0.5, "trigger": 2, "total": 30, "lease_timeout_s": 5.0, "eta": 2, "dataset_size": 7}



def _pick(data: st.DataObject, leases: dict[str, int]) -> str:
    """A lease id by position in insertion order (ids are random, positions are reproducible)."""
    keys = list(leases)
    return keys[data.draw(st.integers(0, len(keys) - 1))]

class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.db = Path(self.dir.name) / "ledger.sqlite"
        self.core = make_core(self.db, **PARAMS)
        self.now = 0.0
        self.outstanding: dict[str, int] = {}  # lease_id -> seq, granted and not yet answered by us
        self.answered: dict[str, int] = {}  # lease ids we already submitted (for duplicates)
        self.returned: dict[str, int] = {}  # lease ids we returned and have not submitted since
        self.trained: dict[int, int] = {}  # seq -> times delivered and not rolled back
        self.delivered_at: dict[str, tuple[int, int]] = {}  # lease_id -> (seq, step), not filtered
        self.step = 0
        self.checkpoint_step = 0
        self.version = 0

    def teardown(self) -> None:
        self.core.ledger.close()
        self.dir.cleanup()

    @rule(k=st.integers(1, 6))
    def lease(self, k: int) -> None:
        room = self.core.max_required_samples - self.core.status(self.now).budget_used
        grant = self.core.lease("r", k, self.now)
        assert len(grant.leases) <= max(0, room), "granted beyond the staleness budget"
        for lease in grant.leases:
            self.outstanding[lease.lease_id] = lease.seq

    @precondition(lambda self: self.outstanding)
    @rule()
    def renew(self) -> None:
        """Renewals at the current clock reading: one in the instant of the grant gives a lease
        the deadline it already has (a second, equal entry on the expiry heap)."""
        self.core.renew("r", list(self.outstanding), self.now)

    @rule(dt=st.floats(0.5, 8.0))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.core.expire(self.now)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        # Pick by position in insertion order: lease ids are random, positions are reproducible.
        keys = list(self.outstanding)
        picks = data.draw(st.lists(st.integers(0, len(keys) - 1), min_size=1, max_size=4, unique=True))
        ids = [keys[p] for p in picks]
        groups = [group_for(i, self.outstanding[i], self.version) for i in ids]
        statuses = self.core.submit("r", groups, self.now)
        for i, s in zip(ids, statuses, strict=True):
            assert s in (SubmitStatus.ACCEPTED, SubmitStatus.EXPIRED)
            self.answered[i] = self.outstanding.pop(i)

    @precondition(lambda self: self.answered)
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        i = _pick(data, self.answered)
        before = self.core.queued
        statuses = self.core.submit("r", [group_for(i, self.answered[i], 0)], self.now)
        assert statuses in ([SubmitStatus.DUPLICATE], [SubmitStatus.EXPIRED])
        assert self.core.queued == before

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        i = _pick(data, self.outstanding)
        self.core.return_leases("r", [i], self.now)
        self.returned[i] = self.outstanding.pop(i)

    @precondition(lambda self: self.returned)
    @rule(data=st.data())
    def submit_after_return(self, data: st.DataObject) -> None:
        """A submit that crossed the ReturnLeases of its own lease (a drain racing a submit)."""
        i = _pick(data, self.returned)
        seq = self.returned.pop(i)
        (status,) = self.core.submit("r", [group_for(i, seq, self.version)], self.now)
        assert status in (SubmitStatus.ACCEPTED, SubmitStatus.EXPIRED)
        self.answered[i] = seq

    @precondition(lambda self: self.answered)
    @rule(data=st.data())
    def return_after_submit(self, data: st.DataObject) -> None:
        i = _pick(data, self.answered)
        def books() -> tuple[object, ...]:
            s = self.core.status(self.now)
            return s.in_flight, s.queued, s.retry_pending, s.budget_used, s.totals

        before = books()
        assert self.core.return_leases("r", [i], self.now) == 0
        assert books() == before

    @rule(n=st.integers(1, 5), filter_one=st.booleans(), ahead=st.booleans())
    def fetch(self, n: int, filter_one: bool, ahead: bool) -> None:
        self.step += 1
        filtered = []
        if filter_one:
            filtered = list(self.delivered_at)[:1]  # reported late: maybe after a commit or checkpoint
        batch = self.core.fetch("t", self.step, n, self.now, filtered, self.version + 1 if ahead else None)
        for f in filtered:
            seq, _ = self.delivered_at.pop(f)
            self.trained[seq] -= 1
        for g in batch.groups:
            self.trained[g.seq] = self.trained.get(g.seq, 0) + 1
            assert self.trained[g.seq] == 1, f"prompt {g.seq} trained twice"
            self.delivered_at[g.lease_id] = (g.seq, self.step)
            if self.core.settings.max_staleness_versions is not None:
                assert g.staleness <= self.core.settings.max_staleness_versions

    @rule()
    def commit(self) -> None:
        self.version += 1
        self.core.commit_version(self.version, str(self.version).encode())

    @rule()
    def checkpoint(self) -> None:
        """A trainer checkpoints a step after the version it trained at is committed: one that
        holds groups fetched ahead for an uncommitted version is refused, and changes nothing."""
        if self.core._ahead:
            before = self.core.status(self.now)
            with pytest.raises(FailedPrecondition, match="not committed"):
                self.core.report_checkpoint(self.step, self.version, f"/ckpt/{self.step}")
            assert self.core.status(self.now) == before
            return
        self.checkpoint_step = self.step
        self.core.report_checkpoint(self.step, self.version, f"/ckpt/{self.step}")
        # its groups stay in delivered_at: a late filter may still name them

    @rule()
    def trainer_crash_and_resume(self) -> None:
        self.core.resume_trainer(self.checkpoint_step)
        for k, (seq, s) in list(self.delivered_at.items()):
            if s > self.checkpoint_step:
                self.trained[seq] -= 1
                del self.delivered_at[k]
        self.step = self.checkpoint_step

    @rule()
    def coordinator_restart(self) -> None:
        before = self.core.status(self.now)
        self.core.ledger.close()
        self.core = make_core(self.db, **PARAMS)
        after = self.core.status(self.now)
        assert (after.policy_version, after.in_flight, after.queued, after.budget_used, after.totals) == (
            before.policy_version, before.in_flight, before.queued, before.budget_used, before.totals,
        )

    @invariant()
    def books_balance(self) -> None:
        report = self.core.audit()
        assert report["balanced"], report
        st_ = self.core.status(self.now)
        # The count holds a unit for every prompt leased or queued, and for every delivered
        # group to be trained at the current version or later (it was counted at the last
        # commit, or leased since); nothing else (GroupState: 1 delivered, 2 consumed).
        held = self.core.ledger._db.execute(
            "SELECT COUNT(*) FROM groups WHERE state IN (1, 2) AND min_version + staleness >= ?",
            (self.core.policy_version,),
        ).fetchone()[0]
        assert st_.budget_used == st_.in_flight + st_.queued + held, (st_.budget_used, st_.in_flight, st_.queued, held)


TestCoordinatorProperties = CoordinatorMachine.TestCase
TestCoordinatorProperties.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
