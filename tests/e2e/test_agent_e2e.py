"""End to end, agents: `meshrl train configs/examples/tool_add.yaml`, shortened. Five real services
on a local Ray Serve, real gRPC, the tiny Qwen3 warm-started on partly formatted tool traces, real
multi-turn trajectories against the calculator tool, real optimizer steps: the reward and the
tool-call rate rise, the ledger balances, lengths count policy tokens (the environment's are
masked).
(The warm start is built on first use and cached, like the built-in example's.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "examples" / "tool_add.yaml"
TOOLS = ROOT / "configs" / "examples" / "tool_add_tools.yaml"


def _train(run_dir: Path, *overrides: str, timeout_s: float = 1200) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "MESHRL_LOG_LEVEL": "WARNING",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "meshrl.cli", "train", str(CONFIG), f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS}",
           *overrides, "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    assert out.returncode == 0, f"meshrl train failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return json.loads((run_dir / "summary.json").read_text())


def test_tool_task_learns_to_call_the_tool(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 40
    summary = _train(run_dir, f"rollout.total_rollout_steps={16 * steps}", "trainer.test_freq=20", "trainer.save_freq=-1")
    assert summary["audit"]["balanced"], summary["audit"]
    assert summary["audit"]["lost"] == 0 and summary["audit"]["duplicated"] == 0
    assert summary["audit"]["issued"] == 16 * steps
    assert summary["max_staleness_seen"] <= 1
    recs = [json.loads(line) for line in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines() if line]
    assert len(recs) == steps
    k = steps // 5

    def mean(key: str, part: list[dict]) -> float:
        return sum(r[key] for r in part) / len(part)

    first, last = mean("critic/rewards/mean", recs[:k]), mean("critic/rewards/mean", recs[-k:])
    assert last > first + 0.1, f"reward did not rise: first {first:.3f} -> last {last:.3f}"
    rate0, rate1 = mean("agent/tool_call_rate", recs[:k]), mean("agent/tool_call_rate", recs[-k:])
    assert rate1 > rate0, f"the policy did not learn to call the tool: {rate0:.3f} -> {rate1:.3f}"
    assert all(r["agent/num_turns/mean"] >= 1 for r in recs)
    # Lengths count policy tokens; trajectories (policy + environment) are longer.
    assert all(r["agent/trajectory_length/mean"] > r["response_length/mean"] for r in recs if r["agent/tool_call_rate"] > 0)
    vals = [json.loads(line) for line in (run_dir / "metrics" / "validation.jsonl").read_text().splitlines() if line]
    assert vals and all("val/tool_call_rate" in v for v in vals)
    for rel in ("report.html", "hf_export/config.json"):
        assert (run_dir / rel).exists(), rel
    html = (run_dir / "report.html").read_text()
    assert "agent/tool_call_rate" in html and "agent/num_turns/mean" in html  # the tool-use plots
