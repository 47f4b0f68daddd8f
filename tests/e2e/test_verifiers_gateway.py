"""`meshrl train` on a `verifiers` environment through the OpenAI-compatible gateway: five services on
Ray Serve, the tiny Qwen3 warm start, real optimizer steps, `agent.command` = the verifiers agent
(examples/verifiers_agent/, in .venv-verifiers; without it this test skips and says so). Every
reward the trainer consumed came from the rubric applied to the completion verifiers saw, both
outcomes occur, the ledger balances. tests/integration/test_verifiers_gateway.py plays the same
environment with a scripted policy, trajectory by trajectory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_verifiers_gateway import rubric, vf_python  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "examples" / "tool_add.yaml"

pytestmark = pytest.mark.slow


def test_meshrl_trains_on_the_rubrics_rewards(vf_python: str, tmp_path: Path) -> None:  # noqa: F811  (the fixture)
    run_dir, log = tmp_path / "run", tmp_path / "agent.jsonl"
    # 8 prompts x 4 samples: the warm start is right on few sums, and the check below wants both outcomes
    steps, n, prompts = 2, 4, 4
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "MESHRL_LOG_LEVEL": "WARNING",
           "PYTHONUNBUFFERED": "1", "VERIFIERS_AGENT_LOG": str(log)}
    cmd = [sys.executable, "-m", "meshrl.cli", "train", str(CONFIG), "actor_rollout_ref.rollout.multi_turn.enable=false",
           "agent.command=[.venv-verifiers/bin/python, examples/verifiers_agent/agent.py]",  # as README writes it
           "agent.max_concurrent=8", f"actor_rollout_ref.rollout.n={n}",
           f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}", f"rollout.total_rollout_steps={prompts * steps}",
           "async_training.concurrent_samples_per_replica=8", "trainer.test_freq=-1", "trainer.save_freq=-1",
           "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, f"meshrl train failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    audit = json.loads((run_dir / "summary.json").read_text())["audit"]
    assert audit["balanced"], audit
    assert audit["lost"] == 0 and audit["duplicated"] == 0 and audit["issued"] == prompts * steps
    recs = [json.loads(line) for line in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines() if line]
    assert len(recs) == steps
    assert all(r["agent/num_turns/mean"] >= 1 for r in recs)
    # what verifiers saw, sample by sample: meshrl's leased prompts, the rubric's rewards
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) >= prompts * steps * n
    for rec in records:
        assert re.fullmatch(r"\d{3}\+\d{3}=", rec["question"]), rec
        assert rec["reward"] == rubric(rec["question"], rec["completion"]), rec
    assert {rec["reward"] for rec in records} == {0.0, 1.0}, "the warm start is right on some answers only"
    # the rewards the trainer trained on are those: with no group played twice (no retries), the
    # samples it consumed are exactly the logged ones
    if len(records) == prompts * steps * n:
        trained = sum(r["critic/rewards/mean"] for r in recs) / steps
        assert trained == pytest.approx(sum(rec["reward"] for rec in records) / len(records), abs=1e-6)
