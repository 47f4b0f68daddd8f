"""TensorBoard event files for a run directory, written from its metrics JSONL (trainer steps,
validation, rollout samples) so every number lives in one place and TensorBoard sees the same."""

from __future__ import annotations

import json
from pathlib import Path


def write_tensorboard(run_dir: str | Path) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    run = Path(run_dir)
    out = run / "tensorboard"
    writer = SummaryWriter(log_dir=str(out))
    try:
        for name, step_key in (("trainer", "step"), ("validation", "policy_version"), ("rollout", None)):
            path = run / "metrics" / f"{name}.jsonl"
            if not path.exists():
                continue
            for i, line in enumerate(path.read_text().splitlines()):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                step = int(rec.get(step_key, i)) if step_key else i
                wall = rec.get("time")
                for key, value in rec.items():
                    if key in ("step", "time", "time_s", "replica_id") or not isinstance(value, int | float):
                        continue
                    tag = key if "/" in key else f"{name}/{key}"
                    writer.add_scalar(tag, float(value), global_step=step, walltime=wall)
    finally:
        writer.close()
    return out
