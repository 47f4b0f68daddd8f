"""One coordinator process per ledger file.

Two coordinators on one ledger each rebuild their state from it once and then write their own over
the other's: both lease the same prompt positions, and each save of the run state rolls back the
other's cursor and counts (a sweep that set one coordinator.ledger_path for every run, a second
`meshrl train --resume` of a run still going, a Serve replacement replica while the old one still
runs its sweeper)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition
from services.coordinator import ledger as ledger_mod

from .coord_helpers import make_core

REPO = Path(__file__).resolve().parents[2]
HOLD = "import sys\nfrom services.coordinator.ledger import Ledger\nL = Ledger(sys.argv[1])\nprint('open', flush=True)\nsys.stdin.read()\n"


def _holder(db: Path) -> subprocess.Popen[bytes]:
    """Another process (another coordinator) holding the ledger open until its stdin closes."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == b"open\n"
    return proc


def test_a_second_coordinator_process_on_the_same_ledger_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "ledger.sqlite"
    make_core(db).ledger.close()
    monkeypatch.setattr(ledger_mod, "OWNER_WAIT_S", 0.3, raising=False)
    holder = _holder(db)
    try:
        with pytest.raises(FailedPrecondition, match=rf"ledger {re.escape(str(db))} is in use by another coordinator \(pid {holder.pid} "):
            second = make_core(db)
            # what followed before: both lease the same prompts
            print("second coordinator leased", [lease.seq for lease in second.lease("r", 2, 0.0).leases])
    finally:
        holder.kill()
        holder.wait()
    # A coordinator that died (kill -9: a crashed replica) leaves the ledger to the next one at once.
    core = make_core(db)
    assert [lease.seq for lease in core.lease("r", 2, 0.0).leases] == [0, 1]
    core.ledger.close()


def test_a_coordinator_waits_for_the_one_it_replaces_to_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve starts a replacement replica while the old one shuts down: the new one waits."""
    db = tmp_path / "ledger.sqlite"
    monkeypatch.setattr(ledger_mod, "OWNER_WAIT_S", 30.0, raising=False)
    holder = _holder(db)
    assert holder.stdin is not None
    holder.stdin.close()  # it exits now, while the next one waits for the ledger
    core = make_core(db)
    assert holder.wait(timeout=30) == 0
    assert core.ledger.path == str(db)
    core.ledger.close()
    # in one process, opening the file again (a test's reopen) shares the one lock
    a, b = make_core(db), make_core(db)
    a.ledger.close()
    b.ledger.close()
