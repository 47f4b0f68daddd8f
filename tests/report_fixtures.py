"""A run directory as `meshrl train` leaves it (metrics, summary, resolved config), written from
numbers made up here, for the report's tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml


def make_run_dir(path: Path, *, steps: int = 40, agent: bool = False, mode: str = "fully_async") -> Path:
    (path / "metrics").mkdir(parents=True, exist_ok=True)
    t0 = 1_800_000_000.0
    with (path / "metrics" / "trainer.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            rec = {"step": s, "time": t0 + 2.0 * s, "critic/rewards/mean": 0.3 + 0.5 * (1 - math.exp(-s / 15)),
                   "staleness/mean": 0.5 + 0.1 * math.sin(s), "perf/throughput_tokens_per_s": 2000 + 10 * s,
                   "perf/idle_ratio": 0.2, "timing_s/step": 2.0, "timing_s/publish": 0.05, "actor/grad_norm": 0.4}
            if agent:
                rec |= {"agent/num_turns/mean": 2.0 + s / 20, "agent/tool_call_rate": 0.4}
            f.write(json.dumps(rec) + "\n")
    with (path / "metrics" / "validation.jsonl").open("w") as f:
        for v in (0, steps // 2, steps):  # one version per step; validated right after the step
            f.write(json.dumps({"policy_version": v, "time": t0 + 2.0 * v + 1.0, "val/score": 0.4 + v / 100,
                                "val-core/openai/gsm8k/acc/mean@1": 0.3 + v / 200,
                                "val-aux/openai/gsm8k/format/mean@1": 0.9,
                                "val-core/meshrl/addition/reward/mean@1": 0.5 + v / 120}) + "\n")
    with (path / "metrics" / "rollout.jsonl").open("w") as f:
        for i in range(10):
            f.write(json.dumps({"time": t0 + 0.2 * steps * i + 0.5, "replica_id": "r0", "rollout/idle_ratio": 0.3,
                                "rollout/tokens_per_s": 900.0, "rollout/weight_load_s": 0.02}) + "\n")
    summary = {"mode": mode, "started_unix_s": t0, "wall_s": 2.0 * steps, "steps": steps, "policy_versions": steps,
               "staleness_histogram": {"0": 3 * steps, "1": steps}, "max_staleness_seen": 1,
               "audit": {"issued": 4 * steps, "in_flight": 0, "retry": 0, "groups": 4 * steps, "balanced": True,
                         "lost": 0, "duplicated": 0},
               "totals": {"prompts_total": str(4 * steps), "consumed": str(4 * steps)}}
    (path / "summary.json").write_text(json.dumps(summary))
    cfg = {"actor_rollout_ref": {"model": {"path": "Qwen/Qwen3-8B"}, "rollout": {"n": 4, "name": "transformers"},
                                 "actor": {"strategy": "fsdp2", "optim": {"lr": 1e-6}}},
           "algorithm": {"adv_estimator": "grpo"},
           "async_training": {"mode": mode, "staleness_threshold": 1.0, "trigger_parameter_sync_step": 1},
           "trainer": {"project_name": "p", "experiment_name": "e", "logger": ["console", "jsonl"],
                       "nnodes": 1, "n_gpus_per_node": 1}}
    (path / "config.resolved.yaml").write_text(yaml.safe_dump(cfg))
    return path
