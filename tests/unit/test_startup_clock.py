"""The start-up clock: each process's phases in MESHRL_LOG_DIR/startup, and the run's timeline."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from services.common.startup import StartupClock, process_started_unix, timeline


def test_process_start_is_before_now_and_after_boot() -> None:
    started = process_started_unix()
    if started is None:
        pytest.skip("no /proc here")
    assert started <= time.time() + 0.01
    # This test process started within the session (minutes), not at boot or in the future.
    assert time.time() - started < 24 * 3600
    assert process_started_unix(2**31 - 1) is None  # no such process


def test_marks_are_written_at_every_mark_and_put_on_the_run_clock(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHRL_LOG_DIR", str(tmp_path))
    t0 = time.time()
    clock = StartupClock("rollout")
    path = tmp_path / "startup" / f"rollout.{os.getpid()}.json"
    assert set(json.loads(path.read_text())["marks"]) >= {"constructor"}  # a hung start-up shows how far it got
    clock.mark("engine_built")
    clock.mark("ready")
    line = timeline(tmp_path, t0)
    marks = line[f"rollout.{os.getpid()}"]
    assert list(marks)[-2:] == ["engine_built", "ready"]
    assert 0 <= marks["constructor"] <= marks["engine_built"] <= marks["ready"]
    if "process_started" in marks:  # the spawn and imports before the constructor
        assert marks["process_started"] <= marks["constructor"]
        assert next(iter(marks)) == "process_started"


def test_timeline_skips_unreadable_files_and_orders_processes_by_start(tmp_path: Path) -> None:
    d = tmp_path / "startup"
    d.mkdir()
    (d / "broken.1.json").write_text("{not json")
    (d / "nomarks.2.json").write_text(json.dumps({"service": "x", "pid": 2}))
    (d / "b.3.json").write_text(json.dumps({"service": "trainer", "pid": 3, "marks": {"ready": 110.0, "constructor": 105.0}}))
    (d / "a.4.json").write_text(json.dumps({"service": "coordinator", "pid": 4, "marks": {"constructor": 101.5}}))
    line = timeline(tmp_path, 100.0)
    assert list(line) == ["coordinator.4", "trainer.3"]
    assert line["trainer.3"] == {"constructor": 5.0, "ready": 10.0}


def test_nothing_is_written_without_a_log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHRL_LOG_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    StartupClock("reward").mark("ready")
    assert list(tmp_path.iterdir()) == []
