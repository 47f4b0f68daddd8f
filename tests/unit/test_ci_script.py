"""`.ci/run`'s exit trap: a green run exits 0 and a failed one keeps its failure.

The trap kills side jobs that may already have ended; under `set -euo pipefail` any command in it
that finds nothing to kill must not turn a green run's exit status into 1.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CI = Path(__file__).resolve().parents[2] / ".ci" / "run"


def _trap_line() -> str:
    lines = [line for line in CI.read_text().splitlines() if re.match(r"^trap '.*' EXIT$", line)]
    assert len(lines) == 1, f".ci/run should set one EXIT trap, found {lines}"
    return lines[0]


def _run_with_trap(last_command: str) -> int:
    # side jobs that have already ended: their pids name no process (nor any children)
    script = "\n".join(
        [
            "set -euo pipefail",
            "(exit 0) & envs_pid=$!",
            "(exit 0) & vllm_pid=$!",
            "(exit 0) & lint_pid=$!",
            "wait",
            _trap_line(),
            last_command,
        ]
    )
    return subprocess.run(["bash", "-c", script], capture_output=True, timeout=30).returncode


def test_a_green_run_exits_zero_when_the_side_jobs_have_ended() -> None:
    assert _run_with_trap('echo "ci: done"') == 0


def test_a_failed_tier_still_fails_the_run() -> None:
    assert _run_with_trap("exit 3") == 3
