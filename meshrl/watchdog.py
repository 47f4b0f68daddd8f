"""The driver's side of the failure model: what `meshrl train` does when a part of the mesh fails.

    what the driver sees                                 what it does
    the coordinator does not answer (Serve restarts it   waits and says so on one line; it comes back
      on its ledger)                                     on its ledger. Down > OUTAGE_LIMIT_S: stop
    the trainer's loop failed (a rank died, an engine    Serve restarts the trainer replica, which
      error)                                             rebuilds its ranks and resumes from its
                                                         newest checkpoint: the driver waits for it
                                                         up to trainer_service.restart_timeout_s, at
                                                         most trainer_service.max_restarts times in a
                                                         run; otherwise it stops with the cause
    leasing halted (prompt groups kept failing:          stops with the coordinator's reason
      GetStatus halted_reason)
    a new error reported by rollouts (GetStatus          one line on the terminal
      failures), a Serve application not RUNNING

A stop on a failure is a clean stop where the trainer still runs (it checkpoints at its next
step); `summary.json` gets `failure` (the cause, one line), `incidents` (what happened, when) and
`resume` (the command that continues the run), and the CLI prints the last two lines. No Ray here:
the driver feeds observations in; `now` is injected.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import MeshError
from services.common.logging import get_logger

log = get_logger(__name__)

OUTAGE_LIMIT_S = 300.0
"""A coordinator or trainer that does not answer for this long ends the run (a Serve restart of
either takes seconds to a minute; longer means it is not coming back)."""


class RunFailure(Exception):
    """The run stops because of REASON (one line); raised by the watchdog, handled by the driver."""


class RunFailed(MeshError):
    """`meshrl train` ended on a failure. `reason` is the first real cause, on one line;
    `resume` the command that continues the run (empty when nothing ran that could be continued)."""

    def __init__(self, reason: str, run_dir: Path, resume: str = "") -> None:
        self.reason, self.run_dir, self.resume = reason, run_dir, resume
        super().__init__(reason)

    def __reduce__(self) -> tuple[type, tuple[str, Path, str]]:
        return (type(self), (self.reason, self.run_dir, self.resume))


@dataclass
class _Outage:
    since: float | None = None
    error: str = ""

    def failed(self, now: float, error: str) -> float:
        """Seconds down so far."""
        if self.since is None:
            self.since = now
        self.error = error
        return now - self.since

    def ok(self, now: float) -> float | None:
        """Seconds it was down (None when it was not)."""
        if self.since is None:
            return None
        down, self.since = now - self.since, None
        return down


@dataclass
class Watchdog:
    """One run's failure bookkeeping. `failure` is set once the run must stop."""

    run_dir: str
    max_restarts: int = 1
    restart_timeout_s: float = 300.0
    started: float = field(default_factory=time.time)
    failure: str | None = None
    incidents: list[dict[str, Any]] = field(default_factory=list)
    trainer_restarts: int = 0
    _coordinator: _Outage = field(default_factory=_Outage)
    _trainer: _Outage = field(default_factory=_Outage)
    _failed_replicas: set[str] = field(default_factory=set)
    _restart_deadline: float | None = None
    _replica: str = ""
    """The trainer replica seen last: another one is a restart, seen failing or not."""
    _reported: set[str] = field(default_factory=set)
    _app_status: dict[str, str] = field(default_factory=dict)
    _app_message: dict[str, str] = field(default_factory=dict)
    """Serve's message for each application not RUNNING (its failing deployments' errors)."""

    @property
    def resume_command(self) -> str:
        return f"meshrl train --resume {self.run_dir}"

    def _incident(self, now: float, kind: str, detail: str, level: str = "warning", **extra: Any) -> None:
        self.incidents.append({"time_s": round(now - self.started, 1), "kind": kind, "detail": detail, **extra})
        getattr(log, level)(kind, detail=detail, **extra)

    def stop(self, now: float, reason: str) -> None:
        """The run stops because of REASON (the first one counts)."""
        if self.failure is None:
            self.failure = reason
            self._incident(now, "run_stopping", reason, level="error", resume=self.resume_command)

    # ---- coordinator ---------------------------------------------------------------------------

    def coordinator_failed(self, now: float, error: str) -> None:
        if self._coordinator.since is None:
            self._incident(now, "coordinator_unreachable", error, hint="Serve restarts it on its ledger; waiting")
        down = self._coordinator.failed(now, error)
        if down > OUTAGE_LIMIT_S:
            # Serve's word on the coordinator (its replacement's constructor error, e.g. a ledger
            # that is gone) is the cause; the call's error only says that nothing answers
            serve = self._app_message.get("coordinator", "")
            raise RunFailure(f"the coordinator has not answered for {down:.0f} s: {error}"
                             + (f"; Serve: {serve}" if serve else ""))

    def coordinator_ok(self, now: float, status: Any) -> None:
        """A GetStatus answer: report new failures, stop on a halt."""
        down = self._coordinator.ok(now)
        if down is not None:
            self._incident(now, "coordinator_back", f"answering again after {down:.1f} s", down_s=round(down, 1))
        for f in status.failures:
            key = f"{f.error}"
            if key not in self._reported:
                self._reported.add(key)
                self._incident(now, "rollout_failure", f.error, source=f.source, groups=int(f.count))
        if status.halted_reason:
            self.stop(now, f"leasing halted: {status.halted_reason}")

    # ---- trainer -------------------------------------------------------------------------------

    def trainer_unreachable(self, now: float, error: str) -> None:
        """The trainer's status call failed (its replica is being replaced)."""
        if self._trainer.since is None:
            self._incident(now, "trainer_unreachable", error)
        down = self._trainer.failed(now, error)
        if self._restart_deadline is not None and now > self._restart_deadline:
            reason = (f"the trainer failed and was not restarted within trainer_service.restart_timeout_s="
                      f"{self.restart_timeout_s:g} (unreachable: {error})")
            self.stop(now, reason)
            raise RunFailure(reason)
        if down > max(OUTAGE_LIMIT_S, self.restart_timeout_s):
            raise RunFailure(f"the trainer has not answered for {down:.0f} s: {error}")

    def trainer_state(self, now: float, status: dict[str, Any]) -> str:
        """The trainer's status -> the state the driver acts on: `restarting` while Serve brings
        a failed trainer back; `failed` once the run must stop for it."""
        self._trainer.ok(now)
        state = str(status.get("state", "?"))
        replica = str(status.get("replica", ""))
        previous, self._replica = self._replica, replica or self._replica
        if state != "failed":
            if self._restart_deadline is not None and replica not in self._failed_replicas:
                if now > self._restart_deadline:  # the replacement came, but too late
                    self.stop(now, f"the trainer failed and was not restarted within "
                                   f"trainer_service.restart_timeout_s={self.restart_timeout_s:g}")
                    return "failed"
                self._restart_deadline = None
                self._incident(now, "trainer_restarted", f"training again from step {status.get('step', 0)}",
                               step=int(status.get("step", 0)))
            elif previous and replica and replica != previous and replica not in self._failed_replicas:
                # replaced between two looks (its process died, or its failed state came and went
                # unseen): a restart all the same, bounded by max_restarts
                if self.failure is not None or self.trainer_restarts >= self.max_restarts:
                    self.stop(now, f"the trainer replica {previous} was replaced (it died) past "
                                   f"trainer_service.max_restarts={self.max_restarts}")
                    return "failed"
                self.trainer_restarts += 1
                self._incident(now, "trainer_restarted", f"replica {previous} was replaced; training again from "
                               f"step {status.get('step', 0)}", step=int(status.get("step", 0)),
                               restart=self.trainer_restarts)
            return "restarting" if self._restart_deadline is not None else state
        error = " ".join(str(status.get("error") or "unknown error").split())[:500]
        if replica in self._failed_replicas:  # the failed replica has not been replaced yet
            if self._restart_deadline is not None and now > self._restart_deadline:
                self.stop(now, f"the trainer failed ({error}) and was not restarted within "
                               f"trainer_service.restart_timeout_s={self.restart_timeout_s:g}")
                return "failed"
            return "restarting" if self._restart_deadline is not None else "failed"
        self._failed_replicas.add(replica)
        if self.failure is not None or self.trainer_restarts >= self.max_restarts:
            self.stop(now, f"the trainer failed: {error}")
            return "failed"
        self.trainer_restarts += 1
        self._restart_deadline = now + self.restart_timeout_s
        self._incident(now, "trainer_failed", error, restart=self.trainer_restarts,
                       hint=f"Serve restarts it from its newest checkpoint (trainer_service.max_restarts="
                            f"{self.max_restarts}); waiting up to {self.restart_timeout_s:g} s")
        return "restarting"

    # ---- Serve ---------------------------------------------------------------------------------

    def serve_status(self, now: float, apps: dict[str, tuple[str, str]]) -> None:
        """app -> (status, message) from Serve: a change away from RUNNING is reported once, and a
        new message under the same status (a replica that failed its health check, then the
        constructor of each replacement refusing to start: UNHEALTHY throughout)."""
        for app, (status, message) in apps.items():
            before = (self._app_status.get(app, "RUNNING"), self._app_message.get(app, ""))
            self._app_status[app] = status
            self._app_message[app] = message if status != "RUNNING" else ""
            if status != before[0] or (status != "RUNNING" and message != before[1]):
                self._incident(now, "serve_app_status", f"{app}: {status}" + (f": {message}" if message else ""),
                               app=app, status=status)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"incidents": self.incidents, "trainer_restarts": self.trainer_restarts}
        if self.failure is not None:
            out |= {"failure": self.failure, "resume": self.resume_command}
        return out
