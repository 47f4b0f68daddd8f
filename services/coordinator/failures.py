"""Failures the rollout replicas report, and the halt that ends a crash loop.

A rollout replica whose group fails (a reward endpoint that answers garbage, an engine error, a
prompt that cannot be tokenized) gives the lease back with the error (ReturnLeases `error`). The
coordinator keeps the newest distinct errors for GetStatus and counts failed groups in a row: an
accepted group resets the count. At `coordinator.max_consecutive_failures` it halts — no lease is
granted (LeasePrompts answers PAUSED) and GetStatus carries `halted_reason` — so a failure that
repeats everywhere stops costing replicas and prompts, and the reason is on the operator's
terminal. `meshrl resume` (Resume) lifts the halt; `meshrl train` stops the run with the reason.

The halt and its reason are kept in the ledger's run state, like a Stop: a replica restarted in
the session that halted (Serve replacing it) stays halted; a later session (`meshrl train
--resume`) starts unhalted (the cause may have been fixed; if not, the run halts again after the
same number of failures). The error reports and the count in a row are not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_ERROR_CHARS = 500
"""A reported error is cut to this many characters (GetStatus stays small)."""


@dataclass
class FailureReport:
    """One distinct error, as GetStatus shows it."""

    source: str
    """The replica that reported it last."""
    error: str
    count: int
    first_unix_s: float
    last_unix_s: float


class FailureLog:
    """The newest `keep` distinct errors and the halt. No clock: calls take `now`."""

    def __init__(self, max_consecutive: int | None, keep: int = 8) -> None:
        self.max_consecutive = max_consecutive
        self.keep = keep
        self.consecutive = 0
        self.halted_reason = ""
        self._reports: OrderedDict[str, FailureReport] = OrderedDict()

    @property
    def halted(self) -> bool:
        return bool(self.halted_reason)

    def failed(self, source: str, error: str, groups: int, now: float) -> bool:
        """`groups` groups of `source` failed with `error`. True when this report halts the run."""
        error = " ".join(error.split())[:MAX_ERROR_CHARS] or "unknown error"
        rep = self._reports.pop(error, None) or FailureReport(source, error, 0, now, now)
        rep.source, rep.count, rep.last_unix_s = source, rep.count + groups, now
        self._reports[error] = rep
        while len(self._reports) > self.keep:
            self._reports.popitem(last=False)
        self.consecutive += groups
        if self.halted or self.max_consecutive is None or self.consecutive < self.max_consecutive:
            return False
        self.halted_reason = (
            f"{self.consecutive} prompt groups failed in a row (coordinator.max_consecutive_failures="
            f"{self.max_consecutive}); last from {source}: {error}"
        )
        return True

    def restore(self, reason: str) -> None:
        """Halted with `reason` (kept in the ledger) by this session before a restart."""
        self.halted_reason = reason

    def succeeded(self) -> None:
        """A group was accepted: the failures are no longer in a row."""
        self.consecutive = 0

    def clear(self) -> None:
        """Lift the halt (the operator resumed the run)."""
        self.halted_reason = ""
        self.consecutive = 0

    def reports(self) -> list[FailureReport]:
        """Newest first."""
        return [FailureReport(**r.__dict__) for r in reversed(self._reports.values())]
