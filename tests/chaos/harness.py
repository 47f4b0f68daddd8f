"""A `meshrl train` subprocess and the processes of its own Ray, to kill -9 one at a time.

Processes are found by identity inside this run only: the descendants of the `meshrl train`
process (its local Ray's raylet starts every worker) whose title names the Serve replica or the
rank actor, e.g. `ray::ServeReplica:rollout:Rollout` or `ray::TrainWorker.train`. Nothing
outside the run's process tree is ever signalled.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[2]

TITLES = {
    "rollout": "ray::ServeReplica:rollout:Rollout",
    "reward": "ray::ServeReplica:reward:Reward",
    "param_server": "ray::ServeReplica:param_server:ParamServer",
    "coordinator": "ray::ServeReplica:coordinator:Coordinator",
    "trainer_rank": "ray::TrainWorker",
}
"""Process title prefix of each kind of process a chaos test kills."""


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "MESHRL_LOG_LEVEL": os.environ.get("MESHRL_TEST_LOG_LEVEL", "WARNING"),
            "PYTHONUNBUFFERED": "1"}


@dataclass
class Kill:
    """One kill -9, as the test log records it."""

    kind: str
    pid: int
    title: str
    at: float
    """Wall clock (time.time()) of the SIGKILL."""
    step: int
    """Trainer steps recorded when it was sent."""
    in_flight: int | None = None
    """Leases in flight at the coordinator just before it (rollout kills)."""
    replica_id: str = ""
    """The rollout replica's id (from the ledger), for its lease rows."""
    replaced_by: list[int] = field(default_factory=list)
    """Pids of the live processes of this kind once the run recovered (Serve's replacement)."""
    result: dict[str, Any] = field(default_factory=dict)
    """What was measured afterwards (recovery, re-queue times)."""

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "pid": self.pid, "title": self.title, "at": self.at, "step": self.step,
                "in_flight": self.in_flight, "replica_id": self.replica_id, "replaced_by": self.replaced_by,
                **self.result}


class TrainRun:
    """`meshrl train OVERRIDES --run-dir RUN_DIR` in its own process group; its output goes to
    RUN_DIR.out."""

    def __init__(self, run_dir: Path, overrides: list[str], extra: tuple[str, ...] = ()) -> None:
        self.run_dir = run_dir
        self.out_path = run_dir.with_name(run_dir.name + ".out")
        cmd = [sys.executable, "-m", "meshrl.cli", "train", *overrides, "--run-dir", str(run_dir), "--no-report", *extra]
        self._out = self.out_path.open("a")
        self._out.write(f"$ {' '.join(cmd)}\n")
        self._out.flush()
        self.proc = subprocess.Popen(cmd, env=env(), cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._address: str | None = None

    # ---- the run's processes -------------------------------------------------------------------

    def processes(self, kind: str) -> list[psutil.Process]:
        """Live processes of KIND among this run's descendants."""
        prefix = TITLES[kind]
        found = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE and " ".join(p.cmdline()).startswith(prefix):
                    found.append(p)
            except psutil.NoSuchProcess:
                continue
        return found

    def kill(self, kind: str, *, in_flight: int | None = None, pid: int | None = None) -> Kill:
        """SIGKILL the first live process of KIND (there must be one), or the one with PID."""
        procs = [p for p in self.processes(kind) if pid is None or p.pid == pid]
        assert procs, f"no live {kind} process ({TITLES[kind]}{f', pid {pid}' if pid else ''}) under pid {self.proc.pid}"
        victim = procs[0]
        title = " ".join(victim.cmdline())[:80]
        victim.send_signal(signal.SIGKILL)
        return Kill(kind, victim.pid, title, time.time(), len(self.steps()), in_flight)

    # ---- what the run has done -----------------------------------------------------------------

    def steps(self) -> list[tuple[int, float]]:
        """(step, wall clock) of every trainer step so far."""
        path = self.run_dir / "metrics" / "trainer.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            out.append((int(rec["step"]), float(rec["time"])))
        return out

    def status(self) -> Any:
        """GetStatus through the run's Serve gRPC ingress (None while it does not answer)."""
        import grpc

        from services.coordinator.client import CoordinatorClient

        if self._address is None:
            cfg = yaml.safe_load((self.run_dir / "config.resolved.yaml").read_text())
            self._address = f"127.0.0.1:{cfg['serve']['grpc_port']}"

        from meshrl.tokens import OPERATOR_TOKEN_FILE
        from services.common.security import ChannelSecurity

        # GetStatus is the operator's: the token `meshrl train` wrote for this run.
        token_file = self.run_dir / OPERATOR_TOKEN_FILE
        token = token_file.read_text().strip() if token_file.exists() else None

        async def get() -> Any:
            async with CoordinatorClient(self._address, application="coordinator", timeout_s=5.0,
                                         security=ChannelSecurity(token=token)) as c:
                return await c.status()

        try:
            return asyncio.run(get())
        except grpc.RpcError:
            return None

    def log_events(self, service: str, event: str) -> list[dict[str, Any]]:
        out = []
        for path in (self.run_dir / "logs").glob(f"{service}.*.jsonl"):
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("event") == event:
                    out.append(rec)
        return out

    def timeline(self, since: float, limit: int = 80) -> str:
        """Every service's log records (warnings and errors at the chaos tests' log level) and the
        trainer's steps from `since` on, in time order, as seconds after it: what a failed recovery
        prints, so that a run on another machine says where it stalled."""
        from datetime import datetime

        steps = [(s, t) for s, t in self.steps() if t >= since]
        # every 10th step and each after a gap of over 3 s: where the run stalled, not all of it
        lines = [(t - since, f"trainer step {s}" + (f" ({t - prev:.1f} s after the last)" if t - prev > 3 else ""))
                 for (s, t), prev in zip(steps, [since, *(t for _, t in steps)], strict=False) if s % 10 == 0 or t - prev > 3]
        for path in (self.run_dir / "logs").glob("*.jsonl"):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                    at = datetime.fromisoformat(str(rec.pop("timestamp")).replace("Z", "+00:00")).timestamp()
                except (json.JSONDecodeError, KeyError, ValueError, AttributeError):
                    continue
                if at >= since - 5:
                    for k in ("service", "level", "logger"):
                        rec.pop(k, None)
                    event = rec.pop("event", "?")
                    lines.append((at - since, f"{path.stem} {event} {json.dumps(rec, default=str)[:300]}"))
        lines.sort()
        shown = lines if len(lines) <= limit else [*lines[: limit // 2], (0.0, "..."), *lines[-limit // 2 :]]
        return "\n".join(f"{t:+8.1f}s {text}" for t, text in shown)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"meshrl train did not end within {timeout_s:.0f} s; output:\n{self.output()[-4000:]}") from None
        finally:
            self._out.close()

    def stop(self) -> None:
        """Kill the whole process group (a test that failed half way)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def output(self) -> str:
        return self.out_path.read_text()

    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())


def rate(steps: list[tuple[int, float]], start: float, end: float) -> float:
    """Steps per second in [start, end)."""
    return sum(1 for _, t in steps if start <= t < end) / max(1e-9, end - start)


def trained_once(run_dir: Path) -> list[tuple[int, int]]:
    """(seq, times) of every prompt trained (delivered or consumed), from the ledger."""
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    try:
        return [(int(s), int(n)) for s, n in
                db.execute("SELECT seq, COUNT(*) FROM groups WHERE state IN (1, 2) GROUP BY seq").fetchall()]
    finally:
        db.close()


def lease_rows(run_dir: Path, replica_id: str) -> list[tuple[str, int, int, float]]:
    """(lease_id, seq, state, granted_at) of every lease granted to REPLICA_ID."""
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    try:
        return [(str(a), int(b), int(c), float(d)) for a, b, c, d in db.execute(
            "SELECT lease_id, seq, state, granted_at FROM leases WHERE replica_id = ?", (replica_id,)).fetchall()]
    finally:
        db.close()


def last_replica_before(run_dir: Path, at: float) -> str:
    """The replica that was granted the last lease before AT (the run's one rollout replica then)."""
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    try:
        row = db.execute("SELECT replica_id FROM leases WHERE granted_at < ? ORDER BY granted_at DESC LIMIT 1",
                         (at,)).fetchone()
        return str(row[0]) if row else ""
    finally:
        db.close()


def regranted_at(run_dir: Path, seqs: list[int], replica_id: str) -> list[float]:
    """When each of SEQS was leased to a replica other than REPLICA_ID."""
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    try:
        out = []
        for s in seqs:
            row = db.execute("SELECT MIN(granted_at) FROM leases WHERE seq = ? AND replica_id != ?", (s, replica_id)).fetchone()
            if row and row[0] is not None:
                out.append(float(row[0]))
        return out
    finally:
        db.close()


def wait_until(pred: Any, timeout_s: float, what: str, poll_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
