"""A failure inside a coordinator call leaves memory and ledger exactly as they were.

The property machine of test_coordinator_properties runs again with a ledger that fails its k-th
write: every state-changing call is first made to fail at its 1st, 2nd, ... write (until it needs
fewer writes than that and succeeds), and after each failure the core's whole state — every
in-memory table and every ledger row — must equal the state before the call. A coordinator
reopened on the ledger after a failure must agree with the one in memory."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import rule, run_state_machine_as_test

from services.coordinator.core import CoordinatorCore
from services.coordinator.ledger import Ledger

from .coord_helpers import make_core
from .test_coordinator_properties import PARAMS, CoordinatorMachine

_WRITES = (
    "save_state", "insert_leases", "set_lease_state", "set_lease_deadlines", "push_retry", "pop_retry",
    "insert_groups", "deliver_groups", "set_group_state", "requeue_groups", "consume_through_step",
)
_MUTATING = (
    "lease", "renew", "return_leases", "expire", "submit", "fetch", "commit_version", "report_checkpoint",
    "resume_trainer", "set_paused", "set_staleness", "request_checkpoint", "stop", "status",
)


class InjectedFault(sqlite3.OperationalError):
    pass


class FlakyLedger(Ledger):
    """Fails its `fail_at`-th write from now (1-based); 0 = never."""

    fail_at = 0
    writes = 0

    def arm(self, k: int) -> None:
        self.fail_at, self.writes = k, 0


def _flaky(name: str) -> Callable[..., Any]:
    real = getattr(Ledger, name)

    def write(self: FlakyLedger, *args: Any, **kwargs: Any) -> Any:
        self.writes += 1
        if self.fail_at and self.writes == self.fail_at:
            raise InjectedFault(f"injected failure at write {self.writes} ({name})")
        return real(self, *args, **kwargs)

    return write


for _name in _WRITES:
    setattr(FlakyLedger, _name, _flaky(_name))


def snapshot(core: CoordinatorCore) -> dict[str, Any]:
    """Everything the core knows, in memory and in its ledger, in comparable form."""
    def digest(b: bytes | None) -> str | None:
        return None if b is None else hashlib.sha1(b).hexdigest()

    mem = {
        "state": core._state.to_json(),
        "leases": sorted((k, dataclasses.astuple(v)) for k, v in core._leases.items()),
        "deadlines": sorted(core._deadlines),
        "prompt_failures": sorted(core._prompt_failures.items()),
        "set_aside": sorted(core._set_aside),
        "replica_clean": list(core._replica_clean.items()),
        "retry": list(core._retry),
        "queue": [(k, q.lease_id, q.seq, q.min_version, q.qpos, digest(q.payload)) for k, q in core._queue.items()],
        "delivered": sorted(
            (k, d.group_id, d.seq, d.min_version, d.step, d.staleness, d.qpos, d.has_payload)
            for k, d in core._delivered.items()
        ),
        "ahead": core._ahead,
        "next_group_id": core._next_group_id,
        "replicas": sorted(core._replica_seen.items()),
    }
    db = core.ledger._db
    for table in ("run_state", "leases", "retry", "groups", "prompt_failures", "set_aside"):
        mem[f"ledger.{table}"] = [tuple(r) for r in db.execute(f"SELECT * FROM {table} ORDER BY 1")]
    return mem


class AtomicCore:
    """Proxies a CoordinatorCore; every state-changing call is first made to fail at each of its
    ledger writes in turn, each failure checked to leave no trace, then made for real."""

    def __init__(self, core: CoordinatorCore, reopen: Callable[[], CoordinatorCore]) -> None:
        self._core = core
        self._reopen = reopen
        self.failures_checked = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._core, name)
        if name not in _MUTATING:
            return attr
        return self._wrap(name, attr)

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            ledger = self._core.ledger
            assert isinstance(ledger, FlakyLedger)
            bound = inspect.signature(method).bind(*args, **kwargs)
            if name != "expire" and "now" in bound.arguments:
                # Time-driven expiry first (a change of its own), so that what follows is the call's.
                self._wrap("expire", self._core.expire)(bound.arguments["now"])
            k = 1
            while True:
                before = snapshot(self._core)
                ledger.arm(k)
                try:
                    result = method(*args, **kwargs)
                except InjectedFault:
                    ledger.arm(0)
                    after = snapshot(self._core)
                    diff = [key for key in before if before[key] != after[key]]
                    assert not diff, f"{name} failed at write {k} but changed {diff}"
                    self._check_reopened(name, k)
                    self.failures_checked += 1
                    CHECKED["failures"] += 1
                    k += 1
                    continue
                except BaseException:
                    ledger.arm(0)
                    raise
                ledger.arm(0)
                return result

        return call

    def _check_reopened(self, name: str, k: int) -> None:
        """A coordinator opened on the ledger now (as after a crash) holds what the live one holds
        in memory. Opening reads only (same run, same session): the live one is left as it is."""
        reopened = self._reopen()
        try:
            live, again = snapshot(self._core), snapshot(reopened)
            diff = [key for key in _DURABLE if live[key] != again[key]]
            assert not diff, f"{name} failed at write {k}: a coordinator reopened on the ledger differs in {diff}"
        finally:
            reopened.ledger.close()


# What a coordinator rebuilds from its ledger (not: replica liveness and failure marks, the expiry
# heap's stale entries, the next group id, which only has to exceed every id in use)
_DURABLE = ("state", "leases", "prompt_failures", "set_aside", "retry", "queue", "delivered", "ahead")
# Across every example: the machine must have injected (and checked) failures at all.
CHECKED = {"failures": 0, "restarts": 0}


class AtomicMachine(CoordinatorMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core.ledger.close()
        self.core = self._open()  # type: ignore[assignment]

    def _open(self) -> AtomicCore:
        core = make_core(self.db, **PARAMS, ledger=FlakyLedger(self.db))
        return AtomicCore(core, lambda: make_core(self.db, **PARAMS, ledger=FlakyLedger(self.db)))

    @rule()
    def coordinator_restart(self) -> None:
        """The base rule, on an atomic core (the base's would reopen a plain one, ending the
        injection for the rest of the example)."""
        CHECKED["restarts"] += 1
        before = self.core.status(self.now)
        self.core.ledger.close()
        self.core = self._open()  # type: ignore[assignment]
        after = self.core.status(self.now)
        assert (after.policy_version, after.in_flight, after.queued, after.budget_used, after.totals) == (
            before.policy_version, before.in_flight, before.queued, before.budget_used, before.totals,
        )


def test_coordinator_calls_are_atomic() -> None:
    before = dict(CHECKED)
    run_state_machine_as_test(AtomicMachine, settings=settings(
        max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
    # the injection ran (and outlived restarts): a machine that stopped injecting would pass anyway
    assert CHECKED["failures"] > before["failures"] and CHECKED["restarts"] > before["restarts"], CHECKED


def test_a_failed_write_is_invisible_after_a_restart(tmp_path: Path) -> None:
    """The ledger rolls the failed transaction back: a coordinator reopened on it sees the state
    from before the failed call, the same one the live core kept in memory."""
    db = tmp_path / "ledger.sqlite"
    core = make_core(db, ledger=FlakyLedger(db))
    grant = core.lease("r", 3, 0.0)
    assert len(grant.leases) == 3
    assert isinstance(core.ledger, FlakyLedger)
    core.ledger.arm(2)
    try:
        core.lease("r", 2, 0.0)
    except InjectedFault:
        pass
    else:
        raise AssertionError("the injected fault did not fire")
    live = core.status(0.0)
    core.ledger.close()
    reopened = make_core(db).status(0.0)
    assert (reopened.in_flight, reopened.budget_used, reopened.totals) == (live.in_flight, live.budget_used, live.totals)
    assert live.in_flight == 3


def test_a_commit_that_fails_keeps_nothing_and_the_next_transaction_runs(tmp_path: Path) -> None:
    """SQLite can fail the COMMIT itself (disk full, an I/O error, a deferred constraint) and leave
    the transaction open; every later BEGIN then failed ("cannot start a transaction within a
    transaction"), so one failed write wedged the ledger for good. A deferred foreign key makes
    the real COMMIT fail here."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    db = ledger._db
    db.execute("PRAGMA foreign_keys=ON")
    db.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
    db.execute("CREATE TABLE child (pid INTEGER REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED)")
    try:
        with ledger.transaction():
            ledger.save_state({"policy_version": 7})
            db.execute("INSERT INTO child (pid) VALUES (42)")  # no parent 42: fails at COMMIT
    except sqlite3.IntegrityError:
        pass
    else:
        raise AssertionError("the deferred constraint did not fail the COMMIT")
    assert not db.in_transaction
    assert ledger.load().state is None  # the failed transaction's write is not kept
    with ledger.transaction():
        ledger.save_state({"policy_version": 8})
    assert ledger.load().state == {"policy_version": 8}


def test_a_begin_that_fails_leaves_later_transactions_atomic(tmp_path: Path) -> None:
    """A BEGIN that fails (SQLITE_BUSY past the busy timeout: another writer on the file, such as
    an old coordinator replica still alive while Serve starts the new one) left the ledger marked
    as inside a transaction for good: every later call ran statement by statement, and one that
    failed between two writes left a lease RETURNED with no retry row (its prompt lost after a
    restart)."""
    from tests.unit.coord_helpers import make_core

    db = tmp_path / "l.db"
    core = make_core(db)
    a, _ = core.lease("r", 2, 0.0).leases
    core.ledger._db.execute("PRAGMA busy_timeout=0")
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            core.renew("r", [a.lease_id], 1.0)
    finally:
        other.execute("ROLLBACK")
        other.close()

    def boom(*_args: Any, **_kwargs: Any) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    real, core.ledger.push_retry = core.ledger.push_retry, boom  # type: ignore[method-assign]
    with pytest.raises(sqlite3.OperationalError):
        core.return_leases("r", [a.lease_id], 2.0)
    core.ledger.push_retry = real  # type: ignore[method-assign]
    assert core.in_flight == 2
    core.ledger.close()
    again = make_core(db)
    assert again.in_flight == 2 and again.audit()["balanced"]


def test_a_write_that_fails_on_a_full_disk_says_so_and_changes_nothing(tmp_path: Path) -> None:
    """SQLite rolls the whole transaction back itself on some failures (SQLITE_FULL, SQLITE_IOERR,
    SQLITE_NOMEM); the ROLLBACK that followed then failed too ("cannot rollback - no transaction
    is active") and its error was the one the RPC answered with: a full disk (the ledger's
    commonest write failure on a long run) read as a coordinator bug. max_page_count stands in for
    the disk here."""
    from tests.unit.coord_helpers import group_for, make_core

    core = make_core(tmp_path / "ledger.sqlite")
    (a,) = core.lease("r", 1, 0.0).leases
    pages = core.ledger._db.execute("PRAGMA page_count").fetchone()[0]
    core.ledger._db.execute(f"PRAGMA max_page_count = {pages + 1}")
    with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
        core.submit("r", [group_for(a.lease_id, a.seq, 0, tokens=20_000)], 1.0)
    assert core.in_flight == 1 and core.queued == 0
    core.ledger._db.execute("PRAGMA max_page_count = 1073741823")  # space again: the same call goes through
    assert [s.value for s in core.submit("r", [group_for(a.lease_id, a.seq, 0, tokens=20_000)], 1.0)] == ["accepted"]
    core.ledger.close()
