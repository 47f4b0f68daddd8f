"""End to end with LoRA (`actor_rollout_ref.model.lora_rank=32`): the trainer trains a peft
adapter, every version the rollout loads is the adapter alone (grpc), the reward rises, the books
balance, and the export is a PEFT adapter that loads on the run's base model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_train_e2e import _rewards, _train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_lora_example_learns_and_ships_only_the_adapter(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 80
    summary = _train(run_dir, "actor_rollout_ref.model.lora_rank=32", f"rollout.total_rollout_steps={32 * steps}",
                     "trainer.test_freq=-1", "trainer.save_freq=40", extra=("--no-report",))
    assert summary["audit"]["balanced"] and summary["audit"]["lost"] == 0 and summary["audit"]["duplicated"] == 0
    assert summary["max_staleness_seen"] <= 1
    rewards = _rewards(run_dir)
    k = steps // 5
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    assert last > first + 0.08, f"reward did not rise: first {first:.3f} -> last {last:.3f}"
    # the versions crossed as the adapter alone: the last one the coordinator committed is
    # 1.25 MB (rank 32 on every linear layer), not the 3.2 MB model
    import base64
    import sqlite3

    from meshrl.v1 import common_pb2

    state = json.loads(sqlite3.connect(run_dir / "ledger.sqlite").execute("SELECT json FROM run_state").fetchone()[0])
    ref = common_pb2.WeightsRef.FromString(base64.b64decode(state["weights"]))  # stored in its wire form
    assert ref.policy_version == steps and 0 < ref.total_bytes < 1_500_000, ref
    # the export is a PEFT adapter on the run's base checkpoint
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_path = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())["actor_rollout_ref"]["model"]["path"]
    assert (run_dir / "hf_export" / "adapter_config.json").exists()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), run_dir / "hf_export")
    assert any(".lora_B." in n and float(p.abs().sum()) > 0 for n, p in model.named_parameters())
