"""An operator's view of one short real run (`meshrl train` in a subprocess, stdout a file as
under `nohup` or CI): plain progress lines in the log, every Prometheus family on Ray's metrics
endpoint while it runs (found through RUN_DIR/prometheus_sd.json), the trackers fed live
(tensorboard, wandb offline; read back), validation per data_source, a self-contained report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.prometheus_families import ALL, scraped_name
from tests.tracker_readers import wandb_history

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40


def _scrape(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body = resp.read().decode()
    return {m.group(1) for m in re.finditer(r"^(ray_meshrl_[a-z_]+)[{ ]", body, re.M)}


def test_a_run_as_operators_see_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "MESHRL_LOG_LEVEL": "WARNING",
           "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           # Ray's processes report metrics every second instead of every 10 s (a short run)
           "RAY_metrics_report_interval_ms": "1000"}
    for var in ("WANDB_DIR", "TENSORBOARD_DIR"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "meshrl.cli", "train", f"rollout.total_rollout_steps={32 * STEPS}",
           "trainer.test_freq=20", "trainer.val_before_train=false",
           "trainer.logger=[console,jsonl,tensorboard,wandb]", "--run-dir", str(run_dir)]
    log_path = tmp_path / "stdout.log"
    want = {scraped_name(f) for f in ALL}
    seen: set[str] = set()
    with log_path.open("w") as log, (tmp_path / "stderr.log").open("w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=err, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 900
            sd = run_dir / "prometheus_sd.json"
            while proc.poll() is None and time.monotonic() < deadline and not want <= seen:
                if sd.exists():
                    for target in json.loads(sd.read_text())[0]["targets"]:
                        port = int(target.rsplit(":", 1)[1])  # scrape over loopback
                        try:
                            seen |= _scrape(port)
                        except OSError:
                            pass  # the agent is not up yet, or Ray is going down
                time.sleep(1.0)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out = log_path.read_text()
    assert rc == 0, out[-3000:] + (tmp_path / "stderr.log").read_text()[-5000:]
    assert want - seen == set(), f"families never scraped: {sorted(want - seen)}"

    # Plain progress in a log: the start line, then step lines with the numbers.
    lines = [line for line in out.splitlines() if line.startswith("train step ")]
    assert out.startswith("train: starting the mesh"), out[:300]
    assert lines and f"/{STEPS} (" in lines[-1], out[-2000:]
    assert all(re.search(r"v\d+  reward [-\d.]+  staleness [-\d.]+  [-\d]+ tok/s", line) for line in lines), lines

    trainer = [json.loads(line) for line in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    vals = [json.loads(line) for line in (run_dir / "metrics" / "validation.jsonl").read_text().splitlines()]
    assert len(trainer) == STEPS and vals
    assert all("val-core/meshrl/addition/acc/mean@1" in v for v in vals), vals[-1].keys()

    # wandb (offline) holds every step's reward; tensorboard was written live.
    hist = wandb_history(run_dir)
    by_step = {int(h["_step"]): h["critic/rewards/mean"] for h in hist if "critic/rewards/mean" in h}
    assert by_step == pytest.approx({r["step"]: r["critic/rewards/mean"] for r in trainer})
    assert any("val-core/meshrl/addition/acc/mean@1" in h for h in hist)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))

    page = (run_dir / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 8 and "meshrl/addition" in page
