"""CPU priority (niceness) of a whole process.

Where the trainer's ranks share CPU cores with the services (the built-in example on a laptop),
the rank's training thread is the bottleneck and every other process preempts it. Ray starts its
workers at niceness 15; `tuning.nice.<app>` moves a service's replicas and
`tuning.nice.trainer_ranks` the trainer's ranks.

On Linux niceness belongs to each thread, and a new thread takes its creator's. A replica or a
rank already runs threads when its code starts (Ray's core worker, gRPC), so every thread in
/proc/self/task is set. Raising niceness (lower priority) is always allowed. Lowering it needs
root, CAP_SYS_NICE or a RLIMIT_NICE (`ulimit -e`) that allows it; without them the process keeps
its niceness and logs why. `tuning.nice.ray_daemons` moves the local Ray's own daemons and Serve's
controller and proxy, which Ray starts at 0 and 15 (`renice_ray_system`).
"""

from __future__ import annotations

import os
from pathlib import Path

from services.common.logging import get_logger

log = get_logger(__name__)

# A local Ray's own processes, by command line, that run no meshrl code: its daemons (GCS,
# autoscaler monitor, dashboard and its workers, log monitor, the raylet's agents) and Serve's
# controller and proxy. Left out: the raylet itself (it forks the workers, which would inherit its
# niceness) and every worker (`ray::IDLE`, the replicas, the ranks: they set their own).
RAY_SYSTEM_PROCESSES = (
    "gcs_server", "autoscaler/_private/monitor.py", "dashboard/dashboard.py", "ray-dashboard-", "log_monitor.py",
    "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::ServeController", "ray::ProxyActor",
)


def _threads(pid: int | str = "self") -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # no procfs: the calling thread only
        return [0] if pid == "self" else []


def _renice(pid: int | str, target: int) -> None:
    """Every thread of process `pid` to niceness `target`. Raises PermissionError for a lowering
    without privilege, which is refused for the first thread alike, before any is changed."""
    for tid in _threads(pid):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def _descendants(root: int) -> list[int]:
    """Every process below `root` (from /proc/*/stat; empty without procfs)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the (command), whatever it holds
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def renice_ray_system(target: int | None, *, key: str, root: int | None = None) -> list[str]:
    """Give every thread of the local Ray's own processes below `root` (this process: the driver
    that started Ray) niceness `target` (None: leave them); see RAY_SYSTEM_PROCESSES. Ray starts
    its daemons at 0, the rank's niceness with the built-in example, so they preempt its training
    thread. Returns the command names changed; a lowering without privilege is logged with the
    fix and changes nothing."""
    if target is None:
        return []
    done: list[str] = []
    for pid in _descendants(os.getpid() if root is None else root):
        cmd = _cmdline(pid)
        name = next((m for m in RAY_SYSTEM_PROCESSES if m in cmd), None)
        if name is None:
            continue
        try:
            _renice(pid, target)
        except PermissionError:
            log.warning(
                "niceness_not_permitted", key=key, niceness=target, process=name,
                fix=f"lowering niceness needs root or CAP_SYS_NICE; set {key} to 0 or higher, or null",
            )
            return done
        done.append(name)
    log.info("niceness_set", key=key, niceness=target, processes=sorted(set(done)))
    return done


def set_niceness(target: int | None, *, key: str) -> int | None:
    """Give every thread of this process niceness `target` (None: leave it). Returns the
    niceness the process has afterwards: `target`, or the one it kept if lowering is not
    permitted (logged with the fix, naming `key`)."""
    if target is None:
        return None
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        _renice("self", target)
    except PermissionError:
        log.warning(
            "niceness_not_permitted", key=key, niceness=target, kept=before,
            fix=f"lowering niceness needs root, CAP_SYS_NICE or `ulimit -e {20 - target}` (RLIMIT_NICE); "
            f"or set {key} to {before} or higher, or null",
        )
        return before
    log.info("niceness_set", key=key, niceness=target, was=before)
    return target
