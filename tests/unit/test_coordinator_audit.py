"""The coordinator replica's periodic ledger audit (deployment.py, every 30 s): it reads the
whole ledger, so it runs in a thread on a connection of its own, and the event loop that serves
every RPC keeps answering meanwhile; it reads one snapshot, so writes made while it reads do not
unbalance it."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from meshrl.v1 import common_pb2
from services.coordinator import deployment
from services.coordinator.ledger import Ledger
from services.coordinator.servicer import CoordinatorServicer

from .coord_helpers import group_for, make_core

SLOW_S = 1.0


def _replica(core: Any) -> Any:
    """A CoordinatorDeployment around `core`, without Serve (its __init__ builds from a config)."""
    replica = object.__new__(deployment.CoordinatorDeployment.func_or_class)
    replica._servicer = CoordinatorServicer(core, sampling=common_pb2.SamplingParams(n=2))
    replica._metrics = None
    replica._exports = 0
    replica._audit = None
    return replica


def test_the_periodic_audit_leaves_the_event_loop_free_and_reads_one_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = make_core(tmp_path / "l.db", staleness=10.0)
    leases = core.lease("r", 4, 0.0).leases
    core.submit("r", [group_for(leases[0].lease_id, leases[0].seq, 0)], 1.0)
    exported: list[dict[str, Any] | None] = []
    monkeypatch.setattr(deployment.metrics, "export", lambda m, status, audit: exported.append(audit))
    loop_thread: list[int] = []
    audit_threads: list[int] = []
    real = Ledger.live_seqs

    def slow_live_seqs(self: Ledger, *args: Any, **kwargs: Any) -> dict[str, list[int]]:
        # a large ledger's scan, stood in for by a sleep
        audit_threads.append(threading.get_ident())
        time.sleep(SLOW_S)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Ledger, "live_seqs", slow_live_seqs)
    replica = _replica(core)

    async def run() -> float:
        loop_thread.append(threading.get_ident())
        gaps: list[float] = []
        stop = False

        async def ticker() -> None:
            last = time.monotonic()
            while not stop:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        result = replica._export_metrics()  # the first export audits
        # as export_periodically awaits it, at once
        pending = asyncio.ensure_future(result) if asyncio.iscoroutine(result) else None
        await asyncio.sleep(SLOW_S / 3)
        # RPCs served while the audit reads: prompts leased, one group submitted
        more = core.lease("r", 3, 2.0).leases
        core.submit("r", [group_for(more[0].lease_id, more[0].seq, 0)], 2.0)
        if pending is not None:
            await pending
        stop = True
        await tick
        return max(gaps)

    worst = asyncio.run(run())
    assert audit_threads and audit_threads[0] != loop_thread[0], "the audit read the ledger on the event loop"
    assert worst < SLOW_S / 2, f"the event loop stalled {worst:.2f} s while the ledger was audited"
    assert exported and exported[-1] is not None and exported[-1]["balanced"], exported
    assert exported[-1]["issued"] == 4  # the snapshot taken when the audit began, not the writes made meanwhile
    monkeypatch.setattr(Ledger, "live_seqs", real)
    assert core.audit()["balanced"] and core.audit()["issued"] == 7


def test_the_health_check_reads_the_ledger_without_scanning_it(tmp_path: Path) -> None:
    """Serve calls check_health every 10 s on the replica's event loop: it counted every group
    of the run (a scan of the groups index, 0.2-0.3 s at 3M groups), so every RPC stalled that
    long, more as the run went on. One row proves the ledger still reads the same at any size."""
    core = make_core(tmp_path / "l.db", staleness=10.0)
    replica = _replica(core)
    db = core.ledger._db

    def steps() -> int:
        n = [0]

        def tick() -> int:
            n[0] += 1
            return 0

        db.set_progress_handler(tick, 100)  # called every 100 SQLite VM instructions
        try:
            replica.check_health()
        finally:
            db.set_progress_handler(None, 0)
        return n[0]

    small = steps()
    with core.ledger.transaction():
        db.executemany(
            "INSERT INTO groups (group_id, lease_id, seq, state, min_version, max_version, qpos) VALUES (?, ?, ?, 2, 0, 0, ?)",
            ((i, f"old-{i}", i, i) for i in range(10_000, 30_000)),
        )
    assert steps() == small
    core.ledger.close()
    with pytest.raises(sqlite3.ProgrammingError):  # a ledger that no longer reads is still unhealthy
        replica.check_health()


def test_a_ledger_without_wal_is_audited_on_the_event_loop_so_writes_are_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLite's unix-dotfile VFS has no shared memory, so it refuses WAL and stays in rollback-journal
    # mode, as on a filesystem without it (some network filesystems): a reader there blocks writers.
    # A 0.2 s busy timeout stands in for an audit scan longer than the default 5 s.
    from services.coordinator import ledger as ledger_mod

    real_connect = sqlite3.connect

    def connect(path: str, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        kwargs.update(uri=True, timeout=0.2)
        return real_connect(f"file:{path}?vfs=unix-dotfile", *args, **kwargs)

    monkeypatch.setattr(ledger_mod.sqlite3, "connect", connect)
    monkeypatch.setattr(ledger_mod, "_own", lambda path: None)  # that VFS locks with the same l.db.lock
    ledger = Ledger(tmp_path / "l.db")
    assert not ledger.wal
    core = make_core(tmp_path / "l.db", staleness=10.0, ledger=ledger)
    leases = core.lease("r", 4, 0.0).leases
    core.submit("r", [group_for(leases[0].lease_id, leases[0].seq, 0)], 1.0)
    real = Ledger.live_seqs

    def slow_live_seqs(self: Ledger, *args: Any, **kwargs: Any) -> dict[str, list[int]]:
        time.sleep(0.6)  # a long scan, holding its read lock
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Ledger, "live_seqs", slow_live_seqs)
    servicer = CoordinatorServicer(core, sampling=common_pb2.SamplingParams(n=2))

    async def run() -> dict[str, Any]:
        pending = asyncio.ensure_future(servicer.audit())
        await asyncio.sleep(0.1)
        # an RPC served meanwhile: its write must not fail with "database is locked"
        more = core.lease("r", 3, 2.0).leases
        core.submit("r", [group_for(more[0].lease_id, more[0].seq, 0)], 2.0)
        return await pending

    report = asyncio.run(run())
    assert report["balanced"], report
    monkeypatch.setattr(Ledger, "live_seqs", real)
    ledger.close()
