"""The coordinator's SQLite ledger (WAL). Every state change is one transaction, committed before
the RPC that caused it is acknowledged; a coordinator restarted on the same file rebuilds its
exact state from it (`Ledger.load`).

Tables
  run_state(id=1, json)       scalars: version, cursor, budget, flags, totals, histogram
  leases(lease_id, seq, ...)  every lease ever granted and its fate
  retry(rid, seq, reason)     prompts waiting to be re-issued (FIFO by rid)
  groups(group_id, ...)       every submitted group: queued -> delivered -> consumed | filtered
                              | rejected (stale); payload kept while it may still be trained on
  prompt_failures(seq, ...)   prompts whose groups failed (ReturnLeases with an error) and that
                              have none accepted yet: how often, counted as the core says (see
                              CoordinatorCore.return_leases)
  set_aside(seq, ...)         prompts that failed coordinator.max_prompt_failures times: never
                              leased again, accounted for by the audit
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sqlite3
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from services.common.errors import FailedPrecondition
from services.common.logging import get_logger

log = get_logger(__name__)

SCHEMA_VERSION = 1
OWNER_WAIT_S = 60.0
"""How long a coordinator waits for the process that holds its ledger to let go of it before it
refuses to start: Serve starts a replacement replica while the old one shuts down (its graceful
shutdown, 20 s by default, then a kill)."""


class LeaseState(IntEnum):
    ACTIVE = 0
    SUBMITTED = 1
    EXPIRED = 2
    RETURNED = 3
    REFUSED = 4  # expired or returned, its prompt re-issued, and a late answer was refused: final


class GroupState(IntEnum):
    QUEUED = 0
    DELIVERED = 1
    CONSUMED = 2
    REJECTED_STALE = 3
    FILTERED = 4


class RetryReason(IntEnum):
    EXPIRED = 0
    RETURNED = 1
    STALE = 2
    TRAINER_RESUME = 3


@dataclass
class LeaseRow:
    lease_id: str
    seq: int
    replica_id: str
    state: LeaseState
    granted_at: float
    deadline: float
    granted_version: int


@dataclass
class GroupRow:
    group_id: int
    lease_id: str
    seq: int
    state: GroupState
    min_version: int
    max_version: int
    step: int
    staleness: int
    qpos: int
    payload: bytes | None


@dataclass
class LedgerSnapshot:
    state: dict[str, Any] | None
    active_leases: list[LeaseRow]
    retry: list[tuple[int, int]]
    queued: list[GroupRow]
    delivered: list[GroupRow]
    max_group_id: int
    prompt_failures: dict[int, int]
    """seq -> failures counted (prompts with no group accepted yet)."""
    set_aside: set[int]


_SCHEMA = """
CREATE TABLE IF NOT EXISTS run_state (id INTEGER PRIMARY KEY CHECK (id = 1), json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, replica_id TEXT NOT NULL, state INTEGER NOT NULL,
    granted_at REAL NOT NULL, deadline REAL NOT NULL, granted_version INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS leases_state ON leases(state);
CREATE TABLE IF NOT EXISTS retry (rid INTEGER PRIMARY KEY AUTOINCREMENT, seq INTEGER NOT NULL UNIQUE,
    reason INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    group_id INTEGER PRIMARY KEY, lease_id TEXT NOT NULL UNIQUE, seq INTEGER NOT NULL,
    state INTEGER NOT NULL, min_version INTEGER NOT NULL, max_version INTEGER NOT NULL,
    step INTEGER NOT NULL DEFAULT -1, staleness INTEGER NOT NULL DEFAULT -1, qpos INTEGER NOT NULL,
    payload BLOB);
CREATE INDEX IF NOT EXISTS groups_state ON groups(state);
CREATE TABLE IF NOT EXISTS prompt_failures (seq INTEGER PRIMARY KEY, failures INTEGER NOT NULL, error TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS set_aside (seq INTEGER PRIMARY KEY, failures INTEGER NOT NULL, error TEXT NOT NULL);
"""


# lock file (real path) -> [its fd, Ledgers of this process open on it]: a process opens it once,
# as closing any descriptor of a file drops the process's POSIX locks on it
_owned: dict[str, list[int]] = {}


def _own(path: str) -> str | None:
    """Take the ledger for this process: an exclusive lock on PATH.lock, held until close() or the
    process's end (a crash, kill -9, lets go at once). Two coordinators on one ledger each rebuild
    their state from it once and then write their own over the other's: both lease the same
    prompt positions, and each save of the run state rolls the other's cursor and counts back.
    Waits OWNER_WAIT_S for a holder to let go, then refuses, naming it. Returns the lock's key."""
    lock = os.path.realpath(path) + ".lock"
    if lock in _owned:
        _owned[lock][1] += 1
        return lock
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + OWNER_WAIT_S
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                # a filesystem without locks (some NFS mounts): run as before, unguarded, and say so
                os.close(fd)
                log.warning("ledger_lock_unavailable", path=lock, error=f"{type(exc).__name__}: {exc}",
                            hint="nothing stops a second coordinator on this ledger: run one only")
                return None
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "pid unknown"
            os.close(fd)
            raise FailedPrecondition(
                f"ledger {path} is in use by another coordinator ({holder}), still after {OWNER_WAIT_S:g} s: "
                "two coordinators on one ledger lease the same prompts and undo each other's counts; stop "
                "the other one (the run it serves), or give this run its own coordinator.ledger_path"
            ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _owned[lock] = [fd, 1]
    return lock


def _file_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _disown(lock: str | None) -> None:
    entry = _owned.get(lock) if lock is not None else None
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _owned[lock]  # type: ignore[arg-type]
        os.close(entry[0])  # the lock goes with it


class Ledger:
    """Write-through persistence for CoordinatorCore. Not thread-safe: one owner (the core), one
    coordinator process per ledger file (see _own)."""

    def __init__(self, path: str | Path, synchronous: str = "NORMAL", *, create: bool = True) -> None:
        """CREATE False: the caller continues a run (`meshrl train --resume`, a replica Serve
        restarted), and a ledger that is not there, or holds no run, is refused before anything
        is written (see _refuse_lost)."""
        self.path = str(path)
        lock = None
        if not create and self.path != ":memory:" and not os.path.exists(self.path):
            self._refuse_lost("does not exist")
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            lock = _own(self.path)
        # let go at close(), or when a Ledger nobody closed is collected
        self._disown = weakref.finalize(self, _disown, lock)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            try:
                if not create and not self._has_run_state():
                    self._refuse_lost("holds no run")
                self._open(synchronous)
                # (device, inode) of the file opened, by absolute path (a later chdir moves nothing):
                # see _check_file. None for ":memory:".
                self._where = None if self.path == ":memory:" else os.path.abspath(self.path)
                self._file = None if self._where is None else _file_id(self._where)
            except BaseException:
                self._db.close()
                raise
        except sqlite3.DatabaseError as exc:
            self._disown()
            raise FailedPrecondition(
                f"ledger {self.path} cannot be opened as a SQLite database ({exc}); point "
                "coordinator.ledger_path at a run's ledger (ledger.sqlite in its run directory) or at a new file"
            ) from exc
        except BaseException:
            self._disown()  # a ledger that did not open is no one's
            raise
        self._in_tx = False

    def _refuse_lost(self, what: str) -> None:
        # A fresh ledger here would start the run over from prompt 0 beside the trainer's checkpoint
        # of the old one, its loss seen, if ever, as a ResumeTrainer or CommitVersion refused later.
        raise FailedPrecondition(
            f"ledger {self.path} {what}, and this coordinator continues a run (`meshrl train --resume`, `meshrl coordinator serve --resume`, or Serve "
            "restarting its replica): a new ledger would start it over from prompt 0; point coordinator.ledger_path "
            "at the run's ledger (ledger.sqlite in its run directory, or where its volume is mounted now), or start a new run (without --resume; a new `meshrl serve-config`)"
        )

    def _has_run_state(self) -> bool:
        """Whether the file holds a run (the run_state row), read without a write: an empty file,
        or a ledger whose first start failed before its first save, holds none."""
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return "run_state" in tables and self._db.execute("SELECT 1 FROM run_state WHERE id = 1").fetchone() is not None

    def _open(self, synchronous: str) -> None:
        # SQLite keeps the rollback journal, silently, where WAL cannot be used (a filesystem without
        # shared memory, as some network ones; "memory" for ":memory:"). The ledger works the same
        # there, but a reader blocks the owner's writes: audit_view then reads on the owner's
        # connection, on its thread, and the audit stalls the event loop as before rather than
        # failing RPCs with "database is locked" once its scan outlasts the busy timeout.
        mode = str(self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
        self.wal = mode == "wal"
        if not self.wal and self.path != ":memory:":
            log.warning("ledger_not_wal", path=self.path, journal_mode=mode,
                        hint="the ledger audit will block the coordinator's event loop while it reads; "
                        "put coordinator.ledger_path on a local filesystem")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute("PRAGMA foreign_keys=OFF")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise FailedPrecondition(
                f"ledger {self.path} was written by a newer meshrl (ledger schema {version}, this one reads "
                f"{SCHEMA_VERSION}): continue the run with that meshrl, or start a new one on a new coordinator.ledger_path"
            )
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if tables - {"sqlite_sequence"} and "run_state" not in tables:
            # another program's database: the ledger's tables would be written into it, a fresh run on it
            raise FailedPrecondition(
                f"ledger {self.path} is not a meshrl ledger (it holds tables {sorted(tables)}); point "
                "coordinator.ledger_path at a run's ledger (ledger.sqlite in its run directory) or at a new file"
            )
        self._db.executescript(_SCHEMA)
        if version < SCHEMA_VERSION:  # new, or written before the version was kept (the same schema)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        self._db.close()
        self._disown()

    def _check_file(self) -> None:
        """Raises when the ledger's path no longer names the file this ledger has open: it was
        deleted, moved or replaced (an operator's cleanup, a restored backup, a remounted volume)
        while the coordinator ran. SQLite (WAL) goes on writing to the file it holds open without
        an error, so every RPC was acknowledged while a restart would read another ledger, or none
        and start the run over from prompt 0. The open file keeps its inode number taken, so a new
        file at the path cannot pass for it."""
        if self._where is None:
            return
        try:
            now: tuple[int, int] | None = _file_id(self._where)
        except FileNotFoundError:
            now = None
        if now != self._file:
            what = "deleted or moved away" if now is None else "replaced by another file"
            raise FailedPrecondition(
                f"ledger {self.path} was {what} while this coordinator ran: what it recorded since is in no file "
                "that a restarted coordinator reads, so it refuses to record more; keep coordinator.ledger_path on "
                "storage that nothing cleans, replaces or remounts while the run lasts"
            )

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic change. Nested use joins the outer transaction."""
        if self._in_tx:
            yield self._db
            return
        self._check_file()  # a write that no restart would read is refused before anything changes
        # Marked open only once BEGIN succeeded: a BEGIN that fails (SQLITE_BUSY past the timeout,
        # an I/O error) left the mark set, and every later transaction then "joined" one that did
        # not exist: each statement committed alone and a failure rolled nothing back.
        self._db.execute("BEGIN IMMEDIATE")
        self._in_tx = True
        try:
            yield self._db
        except BaseException:
            # SQLite rolls the transaction back itself on some failures (SQLITE_FULL, SQLITE_IOERR,
            # SQLITE_NOMEM): a ROLLBACK then failed too, and its "no transaction is active" replaced
            # the error that says what went wrong (a full disk).
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        else:
            try:
                self._db.execute("COMMIT")
            except BaseException:
                # A COMMIT that fails (disk full, I/O error, a deferred constraint) may leave the
                # transaction open: every later BEGIN would then fail. Nothing of it is kept.
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        finally:
            self._in_tx = False

    # ---- writes (call inside transaction()) -------------------------------------------------

    def save_state(self, state: dict[str, Any]) -> None:
        self._db.execute(
            "INSERT INTO run_state (id, json) VALUES (1, ?) ON CONFLICT(id) DO UPDATE SET json = excluded.json",
            (json.dumps(state, separators=(",", ":")),),
        )

    def insert_leases(self, rows: Iterable[LeaseRow]) -> None:
        self._db.executemany(
            "INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(r.lease_id, r.seq, r.replica_id, int(r.state), r.granted_at, r.deadline, r.granted_version) for r in rows],
        )

    def set_lease_state(self, lease_ids: Iterable[str], state: LeaseState) -> None:
        self._db.executemany("UPDATE leases SET state = ? WHERE lease_id = ?", [(int(state), i) for i in lease_ids])

    def set_lease_deadlines(self, items: Iterable[tuple[str, float]]) -> None:
        self._db.executemany("UPDATE leases SET deadline = ? WHERE lease_id = ?", [(d, i) for i, d in items])

    def push_retry(self, seqs: Iterable[int], reason: RetryReason) -> None:
        self._db.executemany("INSERT INTO retry (seq, reason) VALUES (?, ?)", [(s, int(reason)) for s in seqs])

    def pop_retry(self, seqs: Iterable[int]) -> None:
        self._db.executemany("DELETE FROM retry WHERE seq = ?", [(s,) for s in seqs])

    def save_prompt_failures(self, items: Iterable[tuple[int, int, str]]) -> None:
        """(seq, failures, error) rows, replacing the prompts' earlier ones."""
        self._db.executemany("INSERT OR REPLACE INTO prompt_failures VALUES (?, ?, ?)", list(items))

    def drop_prompt_failures(self, seqs: Iterable[int]) -> None:
        self._db.executemany("DELETE FROM prompt_failures WHERE seq = ?", [(s,) for s in seqs])

    def set_aside(self, items: Iterable[tuple[int, int, str]]) -> None:
        """(seq, failures, error): prompts never leased again."""
        self._db.executemany("INSERT INTO set_aside VALUES (?, ?, ?)", list(items))

    def lease_fates(self, lease_ids: Iterable[str]) -> dict[str, tuple[LeaseState, int]]:
        """lease id -> (state, seq) of the given leases the ledger knows (by primary key: the core
        keeps no table of every lease that ever ended)."""
        ids = list(dict.fromkeys(lease_ids))
        out: dict[str, tuple[LeaseState, int]] = {}
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            query = f"SELECT lease_id, state, seq FROM leases WHERE lease_id IN ({','.join('?' * len(chunk))})"
            for r in self._db.execute(query, chunk):
                out[r[0]] = (LeaseState(r[1]), r[2])
        return out

    def set_aside_rows(self) -> list[tuple[int, int, str]]:
        return [(r[0], r[1], r[2]) for r in self._db.execute("SELECT seq, failures, error FROM set_aside ORDER BY seq")]

    def insert_groups(self, rows: Iterable[GroupRow]) -> None:
        self._db.executemany(
            "INSERT INTO groups VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (r.group_id, r.lease_id, r.seq, int(r.state), r.min_version, r.max_version, r.step, r.staleness, r.qpos, r.payload)
                for r in rows
            ],
        )

    def deliver_groups(self, items: Iterable[tuple[int, int, int, bool]]) -> None:
        """(group_id, step, staleness, keep_payload)."""
        rows = list(items)
        self._db.executemany(
            "UPDATE groups SET state = ?, step = ?, staleness = ? WHERE group_id = ?",
            [(int(GroupState.DELIVERED), step, st, gid) for gid, step, st, _ in rows],
        )
        self._db.executemany(
            "UPDATE groups SET payload = NULL WHERE group_id = ?", [(gid,) for gid, _, _, keep in rows if not keep]
        )

    def set_group_state(self, group_ids: Iterable[int], state: GroupState, drop_payload: bool = False) -> None:
        sql = "UPDATE groups SET state = ?" + (", payload = NULL" if drop_payload else "") + " WHERE group_id = ?"
        self._db.executemany(sql, [(int(state), gid) for gid in group_ids])

    def requeue_groups(self, items: Iterable[tuple[int, int]]) -> None:
        """(group_id, new qpos): back to QUEUED, delivery fields cleared."""
        self._db.executemany(
            "UPDATE groups SET state = ?, step = -1, staleness = -1, qpos = ? WHERE group_id = ?",
            [(int(GroupState.QUEUED), q, gid) for gid, q in items],
        )

    def consume_through_step(self, step: int) -> None:
        self._db.execute(
            "UPDATE groups SET state = ?, payload = NULL WHERE state = ? AND step <= ?",
            (int(GroupState.CONSUMED), int(GroupState.DELIVERED), step),
        )

    # ---- reads ------------------------------------------------------------------------------

    def consumed_after_step(self, step: int) -> list[tuple[int, int, int, int]]:
        """(group_id, seq, staleness, train version) of the groups a checkpoint after `step` consumed."""
        return [
            (r[0], r[1], r[2], r[3])
            for r in self._db.execute(
                "SELECT group_id, seq, staleness, min_version + staleness FROM groups WHERE state = ? AND step > ? ORDER BY qpos",
                (int(GroupState.CONSUMED), step),
            )
        ]

    def consumed_groups(self, lease_ids: Iterable[str]) -> list[tuple[int, str, int, int]]:
        """(group_id, lease_id, staleness, train version) of the groups of LEASE_IDS that a
        checkpoint consumed."""
        out = []
        for lease_id in lease_ids:
            row = self._db.execute(
                "SELECT group_id, lease_id, staleness, min_version + staleness FROM groups WHERE lease_id = ? AND state = ?",
                (lease_id, int(GroupState.CONSUMED)),
            ).fetchone()
            if row is not None:
                out.append((row[0], row[1], row[2], row[3]))
        return out

    def load(self) -> LedgerSnapshot:
        row = self._db.execute("SELECT json FROM run_state WHERE id = 1").fetchone()
        state = json.loads(row[0]) if row else None
        leases = [
            LeaseRow(r[0], r[1], r[2], LeaseState(r[3]), r[4], r[5], r[6])
            for r in self._db.execute("SELECT * FROM leases WHERE state = ?", (int(LeaseState.ACTIVE),))
        ]
        retry = [(r[0], r[1]) for r in self._db.execute("SELECT seq, reason FROM retry ORDER BY rid")]

        def groups(state_: GroupState, order: str, payload: str = "payload") -> list[GroupRow]:
            return [
                GroupRow(r[0], r[1], r[2], GroupState(r[3]), r[4], r[5], r[6], r[7], r[8], r[9])
                for r in self._db.execute(
                    "SELECT group_id, lease_id, seq, state, min_version, max_version, step, staleness, qpos, "
                    f"{payload} FROM groups WHERE state = ? ORDER BY {order}", (int(state_),))
            ]

        max_gid = self._db.execute("SELECT COALESCE(MAX(group_id), 0) FROM groups").fetchone()[0]
        failures = {r[0]: r[1] for r in self._db.execute("SELECT seq, failures FROM prompt_failures")}
        aside = {r[0] for r in self._db.execute("SELECT seq FROM set_aside")}
        return LedgerSnapshot(
            state=state,
            active_leases=leases,
            retry=retry,
            queued=groups(GroupState.QUEUED, "qpos"),
            # a delivered group's payload is read when it is queued again (payloads()): b"" marks one kept
            delivered=groups(GroupState.DELIVERED, "qpos", payload="CASE WHEN payload IS NULL THEN NULL ELSE X'' END"),
            max_group_id=int(max_gid),
            prompt_failures=failures,
            set_aside=aside,
        )

    def payloads(self, group_ids: Iterable[int]) -> dict[int, bytes]:
        """The stored payloads of these groups (those that keep one)."""
        ids = list(group_ids)
        out: dict[int, bytes] = {}
        for i in range(0, len(ids), 500):  # under SQLite's limit of host parameters per statement
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            out.update((r[0], r[1]) for r in self._db.execute(
                f"SELECT group_id, payload FROM groups WHERE group_id IN ({marks}) AND payload IS NOT NULL", chunk))
        return out

    def check_readable(self) -> None:
        """Raises when the ledger no longer reads (the health check). One row, whatever the run's
        size: it runs on the owner's event loop every health_check_period_s, where counting the
        groups scanned an index that grows with every group submitted, stalling every RPC."""
        self._check_file()
        if self._db.execute("SELECT json FROM run_state WHERE id = 1").fetchone() is None:
            raise FailedPrecondition(f"ledger {self.path} lost its run state (the run_state row)")

    def audit_view(self) -> tuple[int, dict[str, list[int]]]:
        """(the run state's cursor, live_seqs()) as one snapshot, read on a connection of its own
        (WAL: the owner writes on meanwhile), so another thread may call it: the audit scans the
        whole ledger, seconds on a long run, which the owner's event loop would spend blocked.
        Without WAL (self.wal False: ":memory:", which has no second connection, or a filesystem
        that refused it, where a reader blocks the owner's writes) it reads on the owner's
        connection: call it on the owner's thread then."""
        if not self.wal:
            return self._cursor(self._db), self.live_seqs()
        self._check_file()  # else it reads (or creates) whatever file is at the path now
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA query_only = 1")
            db.execute("BEGIN")  # the snapshot starts at its first read and holds to COMMIT
            try:
                return self._cursor(db), self.live_seqs(db)
            finally:
                db.execute("COMMIT")
        finally:
            db.close()

    @staticmethod
    def _cursor(db: sqlite3.Connection) -> int:
        row = db.execute("SELECT json FROM run_state WHERE id = 1").fetchone()
        return int(json.loads(row[0])["cursor"]) if row else 0

    def live_seqs(self, db: sqlite3.Connection | None = None) -> dict[str, list[int]]:
        """Where every prompt sequence number is now (for audits), read on DB (the owner's
        connection if None)."""
        db = db or self._db
        active = [r[0] for r in db.execute("SELECT seq FROM leases WHERE state = ?", (int(LeaseState.ACTIVE),))]
        retry = [r[0] for r in db.execute("SELECT seq FROM retry")]
        live_states = (int(GroupState.QUEUED), int(GroupState.DELIVERED), int(GroupState.CONSUMED), int(GroupState.FILTERED))
        groups = [
            r[0]
            for r in db.execute(
                f"SELECT seq FROM groups WHERE state IN ({','.join('?' * len(live_states))})", live_states
            )
        ]
        aside = [r[0] for r in db.execute("SELECT seq FROM set_aside")]
        return {"in_flight": active, "retry": retry, "groups": groups, "set_aside": aside}
