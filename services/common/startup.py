"""Where a service's start-up goes. Each service process marks its start-up phases (wall-clock
times) in `MESHRL_LOG_DIR/startup/<service>.<pid>.json`, rewritten at every mark so a start-up that
hangs shows how far it got; `meshrl train` puts every process's marks on its own timeline in
summary.json (`startup_s.timeline`, seconds since `meshrl train` started).

The first mark is the process's own start (from /proc on Linux), so the gap to the next one is the
worker's spawn and the imports of the service's module, which no constructor can time itself."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

DIR = "startup"


def process_started_unix(pid: int | None = None) -> float | None:
    """The Unix time this process started (Linux /proc), or None where /proc is not there."""
    try:
        stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the comm field
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class StartupClock:
    """The start-up phases of one process. `mark(phase)` after each phase; nothing is written
    where MESHRL_LOG_DIR is unset (a service started outside `meshrl train`)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.marks: dict[str, float] = {}
        started = process_started_unix()
        if started is not None:
            self.marks["process_started"] = started
        self.mark("constructor")

    def mark(self, phase: str) -> None:
        self.marks[phase] = time.time()
        log_dir = os.environ.get("MESHRL_LOG_DIR")
        if not log_dir:
            return
        path = Path(log_dir) / DIR / f"{self.service}.{os.getpid()}.json"
        with contextlib.suppress(OSError):  # a timing aid: never a reason for a service not to start
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"service": self.service, "pid": os.getpid(), "marks": self.marks}))
            tmp.replace(path)


def timeline(log_dir: Path, t0_unix: float) -> dict[str, dict[str, float]]:
    """Every process's marks under LOG_DIR as seconds since T0_UNIX, keyed `service.pid`, in the
    order the processes started. A process whose every mark precedes T0_UNIX is an earlier
    session's (a `--resume` writes into the same logs/): left out."""
    out: list[tuple[float, str, dict[str, float]]] = []
    for path in sorted((log_dir / DIR).glob("*.json")):
        try:
            rec: dict[str, Any] = json.loads(path.read_text())
            marks = {str(k): float(v) for k, v in rec["marks"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if marks and max(marks.values()) >= t0_unix:
            first = min(marks.values())
            out.append((first, f"{rec.get('service', path.stem)}.{rec.get('pid', '')}",
                        {k: round(v - t0_unix, 2) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}))
    return {name: marks for _, name, marks in sorted(out)}
