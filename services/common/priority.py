"""CPU priority (niceness) of a whole process.

Where the trainer's ranks share CPU cores with the services (the built-in example on a laptop),
the rank's training thread is the bottleneck and every other process preempts it. Ray starts its
workers at niceness 15; `serve.<app>.nice` moves a service's replicas and
`trainer_service.worker_nice` the trainer's ranks.

On Linux niceness belongs to each thread, and a new thread takes its creator's. A replica or a
rank already runs threads when its code starts (Ray's core worker, gRPC), so every thread in
/proc/self/task is set. Raising niceness (lower priority) is always allowed. Lowering it needs
root, CAP_SYS_NICE or a RLIMIT_NICE (`ulimit -e`) that allows it; without them the process keeps
its niceness and logs why.
"""

from __future__ import annotations

import os

from services.common.logging import get_logger

log = get_logger(__name__)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        return [0]


def set_niceness(target: int | None, *, key: str) -> int | None:
    """Give every thread of this process niceness `target` (None: leave it). Returns the
    niceness the process has afterwards: `target`, or the one it kept if lowering is not
    permitted (logged with the fix, naming `key`)."""
    if target is None:
        return None
    before = os.getpriority(os.PRIO_PROCESS, 0)
    for tid in _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:  # a lowering without privilege: refused for every thread alike
            log.warning(
                "niceness_not_permitted", key=key, niceness=target, kept=before,
                fix=f"lowering niceness needs root, CAP_SYS_NICE or `ulimit -e {20 - target}` (RLIMIT_NICE); "
                f"or set {key} to {before} or higher, or null",
            )
            return before
    log.info("niceness_set", key=key, niceness=target, was=before)
    return target
