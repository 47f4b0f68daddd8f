"""Replica liveness (coordinator.replica_ttl_s) and failure reports (max_consecutive_failures) in
the coordinator core, driven with an injected clock: a silent replica's prompts come back within
the TTL, a live one keeps its leases, a stall of the coordinator itself is not held against anyone,
and a failure that repeats halts leasing with its reason until the operator resumes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from meshrl.v1 import common_pb2
from services.common.data import PromptStream, synthetic_records
from services.coordinator.core import CoordinatorCore, CoordinatorSettings, LeaseLimit, SubmitStatus
from services.coordinator.failures import FailureLog
from services.coordinator.ledger import Ledger
from services.coordinator.liveness import ReplicaLiveness
from services.coordinator.servicer import CoordinatorServicer
from tests.unit.coord_helpers import group_for

TTL = 20.0


def _core(path: Path, *, ttl: float | None = TTL, max_failures: int | None = None, lease_timeout_s: float = 600.0,
          staleness: float = 1.0) -> CoordinatorCore:
    settings = CoordinatorSettings(
        required_samples=4, staleness_threshold=staleness, trigger_parameter_sync_step=1, prompts_total=40,
        lease_timeout_s=lease_timeout_s, session="s1", replica_ttl_s=ttl, max_consecutive_failures=max_failures,
    )
    stream = PromptStream(synthetic_records("addition", 16, digits=2, seed=0, split="train"), shuffle=True, seed=3)
    return CoordinatorCore(settings, stream, Ledger(path))


def _sweep(core: CoordinatorCore, start: float, end: float, *, heartbeat: dict[str, list[str]] | None = None) -> int:
    """What the servicer's sweeper does, once a second from `start` to `end`; replicas in
    `heartbeat` renew their leases every 5 s meanwhile. Returns leases expired."""
    before = _expired(core)
    t = start
    while t <= end:
        for replica, ids in (heartbeat or {}).items():
            if int(t) % 5 == 0:
                core.renew(replica, ids, t)
        core.expire(t)
        t += 1.0
    return _expired(core) - before


def _expired(core: CoordinatorCore) -> int:
    return core.status(-1.0).totals.leases_expired  # a time in the past: checks nothing, expires nothing


def test_a_silent_replicas_prompts_are_back_within_the_ttl_and_free_the_budget(tmp_path: Path) -> None:
    core = _core(tmp_path / "l.db")
    dead = core.lease("dead", 3, 0.0).leases
    alive = core.lease("alive", 10, 0.0).leases
    assert len(alive) == 5 and core.lease("other", 1, 0.0).limit == LeaseLimit.STALENESS_BUDGET  # 8 = 4 * (1 + 1)
    keep = [x.lease_id for x in alive]
    # Nothing happens while "dead" is within its TTL ...
    assert _sweep(core, 1.0, TTL, heartbeat={"alive": keep}) == 0
    # ... and just past it its three leases expire; the live replica keeps its five.
    assert _sweep(core, TTL + 1, TTL + 2, heartbeat={"alive": keep}) == 3
    st = core.status(TTL + 2)
    assert st.in_flight == 5 and st.retry_pending == 3
    assert st.totals.leases_expired == 3 and st.totals.leases_replica_lost == 3
    # The dead replica's prompts stopped counting against the budget: they are leased again at once.
    again = core.lease("new", 10, TTL + 2).leases
    assert sorted(x.seq for x in again) == sorted(x.seq for x in dead)
    # The live replica renewed all along; its leases stay until they are answered.
    assert _sweep(core, TTL + 3, 200.0, heartbeat={"alive": keep, "new": [x.lease_id for x in again]}) == 0
    assert core.submit("alive", [group_for(x.lease_id, x.seq, 0) for x in alive], 201.0) == [SubmitStatus.ACCEPTED] * 5
    assert core.audit()["balanced"]


def test_a_live_replica_that_stops_renewing_one_lease_keeps_it_until_the_lease_timeout(tmp_path: Path) -> None:
    """The TTL is about the replica, not the lease: a replica that keeps calling keeps its
    leases up to coordinator.lease_timeout_s, the bound for a live replica that is slow."""
    core = _core(tmp_path / "l.db", lease_timeout_s=100.0)
    (slow,) = core.lease("r", 1, 0.0).leases
    (other,) = core.lease("r", 1, 0.0).leases
    assert _sweep(core, 1.0, 99.0, heartbeat={"r": [other.lease_id]}) == 0
    assert _sweep(core, 100.0, 101.0, heartbeat={"r": [other.lease_id]}) == 1
    assert core.status(101.0).totals.leases_replica_lost == 0
    assert core.status(101.0).in_flight == 1 and slow.lease_id not in core.renew("r", [slow.lease_id], 102.0)[0]


def test_a_late_answer_from_a_replica_taken_for_dead_is_accepted_or_refused_never_counted_twice(tmp_path: Path) -> None:
    core = _core(tmp_path / "l.db")
    a, b = core.lease("stalled", 2, 0.0).leases
    assert _sweep(core, 1.0, TTL + 2) == 2
    # The first prompt back is re-issued before the stalled replica answers; the second is not.
    (b2,) = core.lease("new", 1, TTL + 2).leases
    a, b = (a, b) if b2.seq == b.seq else (b, a)
    statuses = core.submit("stalled", [group_for(a.lease_id, a.seq, 0), group_for(b.lease_id, b.seq, 0)], TTL + 3)
    assert statuses == [SubmitStatus.ACCEPTED, SubmitStatus.EXPIRED]
    assert core.submit("new", [group_for(b2.lease_id, b2.seq, 0)], TTL + 4) == [SubmitStatus.ACCEPTED]
    assert sorted(g.seq for g in core.fetch("t", 1, 10, TTL + 5).groups) == sorted([a.seq, b.seq])
    assert core.audit()["balanced"]


def test_a_stall_of_the_coordinator_is_not_held_against_the_replicas(tmp_path: Path) -> None:
    """Checks further apart than ttl/4 mean the coordinator did not run (heartbeats may be queued
    behind the check): the gap is credited to every replica."""
    core = _core(tmp_path / "l.db")
    core.lease("r", 2, 0.0)
    assert _sweep(core, 1.0, 10.0) == 0
    assert core.expire(40.0) == 0  # 30 s without a check: a stall, not 40 s of silence
    assert _sweep(core, 41.0, 50.0) == 0
    assert _sweep(core, 51.0, 52.0) == 2  # 10 s before the stall + 11 s after it without a word: gone


def test_leases_restored_from_the_ledger_get_a_full_ttl_from_the_first_check(tmp_path: Path) -> None:
    core = _core(tmp_path / "l.db", lease_timeout_s=5000.0)
    core.lease("gone", 3, 0.0)
    core.ledger.close()
    again = _core(tmp_path / "l.db", lease_timeout_s=5000.0)  # a coordinator restart (or `meshrl train --resume`) at t=1000
    assert again.in_flight == 3
    assert _sweep(again, 1000.0, 1000.0 + TTL) == 0
    assert _sweep(again, 1001.0 + TTL, 1002.0 + TTL) == 3
    assert again.audit()["balanced"]


def test_without_a_ttl_only_the_lease_deadline_counts(tmp_path: Path) -> None:
    core = _core(tmp_path / "l.db", ttl=None, lease_timeout_s=100.0)
    core.lease("gone", 2, 0.0)
    assert _sweep(core, 1.0, 99.0) == 0
    assert _sweep(core, 100.0, 100.0) == 2


def test_liveness_checks_are_spaced_and_new_holders_start_heard() -> None:
    heard: dict[str, float] = {}
    live = ReplicaLiveness(heard, ttl_s=8.0)
    assert live.interval_s == 1.0
    looked: list[float] = []

    def holders(now: float, *names: str) -> Any:
        def get() -> set[str]:
            looked.append(now)
            return set(names)
        return get

    assert live.silent(0.0, holders(0.0, "a")) == set() and live.heard("a", 99.0) == 0.0
    assert live.silent(0.5, holders(0.5, "a")) == set()  # within the check interval: not even looked at
    for t in range(1, 9):
        assert live.silent(float(t), holders(float(t), "a")) == set()
    assert live.silent(9.0, holders(9.0, "a", "b")) == {"a"}  # b was never heard of: it starts now
    assert live.heard("b", 99.0) == 9.0 and 0.5 not in looked and len(looked) == 10
    assert heard == {}  # the shared table is the caller's: a holder is never added to it here
    assert ReplicaLiveness({}, ttl_s=None).silent(1e9, holders(0.0, "a")) == set()


def test_a_flood_of_new_replica_ids_neither_hides_a_dead_holder_nor_fails_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table of recently seen replicas is bounded for ids callers choose; new ids push the
    oldest out. A dead lease holder pushed out must still be found silent at replica_ttl_s (it
    was taken as just heard, its leases then waited for lease_timeout_s), and the sweep must not
    fail the innocent call that runs it (a KeyError there was an INTERNAL error)."""
    monkeypatch.setattr("services.coordinator.core.MAX_REPLICAS_SEEN", 3)
    core = _core(tmp_path / "l.db", ttl=20.0)
    (lease,) = core.lease("dead", 1, 0.0).leases
    core.expire(0.5)  # the first check: holders known from here
    for i, t in enumerate((5.0, 6.0, 7.0, 8.0)):
        core.renew(f"new-{i}", [], t)  # ids nobody holds leases for, pushing "dead" out
    assert "dead" not in core._replica_seen
    expired = {t: core.expire(float(t)) for t in range(9, 23)}  # a check every second, as the sweeper runs
    assert expired[21] == 1 and sum(expired.values()) == 1, expired  # at the ttl, not at lease_timeout_s
    assert lease.lease_id not in core._leases


def test_failures_in_a_row_halt_leasing_with_the_reason_until_resumed(tmp_path: Path) -> None:
    core = _core(tmp_path / "l.db", max_failures=5)
    leases = core.lease("r1", 8, 0.0).leases
    err = "InvalidArgument: endpoint http://x: results[0].item_id is '', expected 'i0'"
    assert core.report_failure("r1", err, 2, 1.0) is False
    assert core.return_leases("r1", [x.lease_id for x in leases[:2]], 1.0) == 2
    # An accepted group breaks the run of failures.
    assert core.submit("r1", [group_for(leases[2].lease_id, leases[2].seq, 0)], 2.0) == [SubmitStatus.ACCEPTED]
    assert core.report_failure("r1", err, 4, 3.0) is False
    assert core.report_failure("r2", "RuntimeError: engine died\n  with a traceback", 1, 4.0) is True
    st = core.status(4.0)
    assert "5 prompt groups failed in a row" in st.halted_reason and "from r2: RuntimeError: engine died" in st.halted_reason
    assert [(f.source, f.error, f.count) for f in st.failures] == [
        ("r2", "RuntimeError: engine died with a traceback", 1), ("r1", err, 6)]
    # Halted: nothing is granted (rollouts see PAUSED and wait), however many ask.
    grant = core.lease("r3", 4, 5.0)
    assert grant.leases == [] and grant.limit == LeaseLimit.PAUSED
    # The operator fixed the cause: Resume lifts the halt and leasing goes on.
    core.set_paused(False)
    assert core.status(6.0).halted_reason == "" and core.lease("r3", 1, 6.0).leases
    assert core.audit()["balanced"]


def test_a_halt_survives_a_restart_of_its_session_and_a_new_session_starts_unhalted(tmp_path: Path) -> None:
    """A coordinator replica that Serve restarts (same session) while the run is halted stays
    halted with the reason: it granted leases again and burned another max_consecutive_failures
    groups on the unfixed cause, and the watchdog never saw the reason. `meshrl train --resume`
    (a new session) starts unhalted, as failures.py says."""
    db = tmp_path / "l.db"

    def core(session: str) -> CoordinatorCore:
        settings = CoordinatorSettings(
            required_samples=4, staleness_threshold=1.0, trigger_parameter_sync_step=1, prompts_total=40,
            lease_timeout_s=600.0, session=session, max_consecutive_failures=2,
        )
        stream = PromptStream(synthetic_records("addition", 16, digits=2, seed=0, split="train"), shuffle=True, seed=3)
        return CoordinatorCore(settings, stream, Ledger(db))

    first = core("a")
    leases = first.lease("r1", 2, 0.0).leases
    assert first.return_leases("r1", [x.lease_id for x in leases], 1.0, "boom") == 2
    assert first.report_failure("r1", "boom", 2, 1.0) is True
    first.ledger.close()
    again = core("a")
    assert "2 prompt groups failed in a row" in again.status(2.0).halted_reason
    assert again.lease("r1", 1, 2.0).limit is LeaseLimit.PAUSED
    # Resume lifts it for good: a later restart of the same session is not halted again.
    again.set_paused(False)
    again.ledger.close()
    lifted = core("a")
    assert lifted.status(3.0).halted_reason == "" and lifted.lease("r1", 1, 3.0).leases
    lifted.report_failure("r1", "boom", 2, 3.0)
    lifted.ledger.close()
    resumed = core("b")
    assert resumed.status(4.0).halted_reason == "" and resumed.lease("r1", 1, 4.0).leases
    resumed.ledger.close()
    assert core("b").status(5.0).halted_reason == ""


def test_failure_log_keeps_the_newest_distinct_errors_and_never_halts_without_a_limit() -> None:
    log = FailureLog(max_consecutive=None, keep=2)
    for i in range(100):
        assert log.failed("r", f"error {i % 3}", 1, float(i)) is False
    assert [r.error for r in log.reports()] == ["error 0", "error 2"]
    assert log.failed("r", "x" * 10_000, 1, 0.0) is False and len(log.reports()[0].error) == 500


def test_sweeper_finds_a_dead_replica_under_a_short_replica_ttl(tmp_path: Path) -> None:
    """With only the servicer's sweeper checking (the run's one replica died), a TTL under 4 s must
    not read every 1 s tick as a coordinator stall: the dead replica's leases return within it."""
    ttl = 2.0
    core = _core(tmp_path / "l.db", ttl=ttl)
    assert len(core.lease("dead", 2, time.time()).leases) == 2

    async def run() -> float:
        servicer = CoordinatorServicer(core, sampling=common_pb2.SamplingParams(n=2))
        servicer.start_sweeper()
        start = time.monotonic()
        try:
            while core.in_flight and time.monotonic() - start < 3 * ttl:
                await asyncio.sleep(0.05)
            return time.monotonic() - start
        finally:
            assert servicer._sweeper is not None
            servicer._sweeper.cancel()

    waited = asyncio.run(run())
    assert core.in_flight == 0, f"the dead replica's leases are still held after {waited:.1f} s (ttl {ttl} s)"
    assert core.status(time.time()).totals.leases_replica_lost == 2
