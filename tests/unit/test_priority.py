"""services/common/priority.py: a process's niceness, every thread of it. Each case runs in a
child process, so that this test process keeps its own priority."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.common.config.loader import load_config
from services.common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux procfs")

PRELUDE = """
import json, os, threading
from services.common.priority import set_niceness

def niceness_of_threads():
    out = set()
    for t in os.listdir("/proc/self/task"):
        try:
            out.add(os.getpriority(os.PRIO_PROCESS, int(t)))
        except ProcessLookupError:  # a thread that ended (just joined) after the listing
            pass
    return sorted(out)

started = threading.Event(); release = threading.Event()
def park():
    started.set(); release.wait()
helper = threading.Thread(target=park, daemon=True); helper.start(); started.wait()  # a thread that exists before
base = os.getpriority(os.PRIO_PROCESS, 0)
"""


def _child(body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body) + "\nrelease.set(); helper.join()\n"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_raising_niceness_covers_every_thread_and_threads_started_later() -> None:
    got = _child("""
        target = min(19, base + 3)
        kept = set_niceness(target, key="serve.rollout.nice")
        seen = []
        later = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0))); later.start(); later.join()
        print(json.dumps({"target": target, "kept": kept, "threads": niceness_of_threads(), "later": seen[0]}))
    """)
    assert got["kept"] == got["target"]
    assert got["threads"] == [got["target"]]  # the thread that existed before as well
    assert got["later"] == got["target"]


def test_a_lowering_that_is_not_permitted_keeps_the_niceness_and_names_the_key() -> None:
    got = _child("""
        real = os.setpriority
        def guarded(which, who, value):  # what an unprivileged user gets for a lowering
            if value < os.getpriority(which, who):
                raise PermissionError(1, "Operation not permitted")
            real(which, who, value)
        os.setpriority = guarded
        raised = min(19, base + 2)
        set_niceness(raised, key="serve.rollout.nice")
        kept = set_niceness(raised - 2, key="tuning.nice.trainer_ranks")
        print(json.dumps({"raised": raised, "kept": kept, "threads": niceness_of_threads()}))
    """)
    assert got["kept"] == got["raised"] and got["threads"] == [got["raised"]]


def test_the_warning_names_the_key_and_the_fix(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.common import priority

    def refuse(which: int, who: int, value: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(priority.os, "setpriority", refuse)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert priority.set_niceness(0, key="tuning.nice.trainer_ranks") == before
    # structlog may write through a stream bound before capsys took over (suite order), or through logging
    out = capsys.readouterr()
    text = out.out + out.err + caplog.text
    assert "niceness_not_permitted" in text and "tuning.nice.trainer_ranks" in text and "CAP_SYS_NICE" in text
    assert priority.set_niceness(None, key="serve.reward.nice") is None


def test_niceness_out_of_range_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"serve\.rollout\.nice"):
        load_config(None, ["serve.rollout.nice=25"])
    with pytest.raises(ConfigError, match=r"trainer_service\.worker_nice"):
        load_config(None, ["trainer_service.worker_nice=-21"])


def _niceness(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


SLEEPER = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)\n"
# argv[1] is the process title (part of its command line, which is what renice_ray_system reads)
RAYLET = """import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, sys.argv[2], title]) for title in ("ray::ServeController", "ray::IDLE")]
print(*(k.pid for k in kids), flush=True)
time.sleep(60)
"""
DRIVER = """import subprocess, sys, time
gcs = subprocess.Popen([sys.executable, sys.argv[1], "gcs_server"])
raylet = subprocess.Popen([sys.executable, sys.argv[2], "raylet", sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(gcs.pid, raylet.pid, raylet.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


def test_ray_system_processes_below_the_driver_are_reniced_and_workers_are_not(tmp_path: Path) -> None:
    """A process tree like a local Ray's: a `gcs_server` child, a `raylet` with a
    `ray::ServeController` and a worker (`ray::IDLE`) below it. tuning.nice.ray_daemons moves the daemon and
    the controller, every thread of them, and leaves the raylet and the worker alone."""
    from services.common.priority import _descendants, renice_ray_system

    for name, text in (("sleeper.py", SLEEPER), ("raylet.py", RAYLET), ("driver.py", DRIVER)):
        (tmp_path / name).write_text(text)
    driver = subprocess.Popen(
        [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "sleeper.py"), str(tmp_path / "raylet.py")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert driver.stdout is not None
        gcs, raylet, controller, worker = (int(x) for x in driver.stdout.readline().split())
        base = _niceness(worker)
        target = min(19, base + 4)
        changed = renice_ray_system(target, key="tuning.nice.ray_daemons", root=driver.pid)
        assert sorted(changed) == ["gcs_server", "ray::ServeController"]
        for pid in (gcs, controller):
            assert {_niceness(int(t)) for t in os.listdir(f"/proc/{pid}/task")} == {target}, pid
        assert _niceness(raylet) == base and _niceness(worker) == base
        assert renice_ray_system(None, key="serve.ray_nice", root=driver.pid) == []
    finally:
        for pid in _descendants(driver.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        driver.kill()
        driver.wait()
