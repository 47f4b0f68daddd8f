"""`meshrl bench e2e`: wall time to a target reward, fully async vs sync on the same mesh, and the
mesh against the plain single-process loop (meshrl/baseline.py) — same model, data and
hyper-parameters — all measured in one run on one machine.

For every case the reward curve is smoothed with a trailing window (`--window` steps); the time to
target is the trainer clock (seconds from the first optimizer step's start, so Ray/Serve start-up,
a constant, is reported separately) at the first step whose smoothed reward reaches the target.
Per-phase seconds come from the trainer's metrics: training (update_actor), weight sync
(publish), trainer idle (waiting for data), and rollout generation (busy time of the replicas).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from services.common.config import MeshConfig


def _smoothed_crossing(records: list[dict[str, Any]], target: float, window: int) -> dict[str, Any] | None:
    rewards = [r["critic/rewards/mean"] for r in records]
    for i in range(window - 1, len(rewards)):
        avg = sum(rewards[i - window + 1 : i + 1]) / window
        if avg >= target:
            return {"step": records[i]["step"], "smoothed_reward": round(avg, 4), "index": i}
    return None


def _load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mesh_case(mode: str, overrides: list[str], target: float, window: int, root: Path) -> dict[str, Any]:
    from meshrl.train import train

    run_dir = root / mode
    t0 = time.time()
    summary = train(None, [*overrides, "trainer.test_freq=-1"], run_dir=run_dir, mode=mode, report=False)
    wall = time.time() - t0
    steps = _load(run_dir / "metrics" / "trainer.jsonl")
    rollout = _load(run_dir / "metrics" / "rollout.jsonl")
    # The first step's record is written when it ends: its start is time - step duration.
    start = steps[0]["time"] - steps[0]["timing_s/step"] if steps else t0
    hit = _smoothed_crossing(steps, target, window)
    to_target = None if hit is None else round(steps[hit["index"]]["time"] - start, 2)
    train_s = sum(r.get("timing_s/update_actor", 0.0) for r in steps)
    busy = [1.0 - r["rollout/idle_ratio"] for r in rollout]
    return {
        "mode": mode,
        "steps": len(steps),
        "startup_s": round(start - t0, 2),
        "train_loop_s": round(steps[-1]["time"] - start, 2) if steps else None,
        "wall_s": round(wall, 2),
        "time_to_target_s": to_target,
        "target_hit": hit,
        "reward_first_10pct": summary["reward_first_10pct"],
        "reward_last_10pct": summary["reward_last_10pct"],
        "phases_s": {
            "training": round(train_s, 2),
            "weight_sync": round(sum(r.get("timing_s/publish", 0.0) for r in steps), 2),
            "trainer_idle": round(sum(r.get("timing_s/wait_data", 0.0) for r in steps), 2),
            "rollout_busy_fraction": round(sum(busy) / len(busy), 3) if busy else None,
        },
        "staleness_histogram": summary["staleness_histogram"],
        "audit_balanced": summary["audit"]["balanced"],
    }


def _baseline_case(cfg: MeshConfig, target: float, window: int, root: Path) -> dict[str, Any]:
    from meshrl.baseline import run_baseline
    from services.reward.client import LocalScorer

    async def main() -> list[dict[str, Any]]:
        scorer = LocalScorer(cfg)
        try:
            path = cfg.actor_rollout_ref.model.path
            assert path is not None
            return await run_baseline(cfg, path, scorer, metrics_path=root / "baseline.jsonl")
        finally:
            await scorer.close()

    t0 = time.time()
    records = asyncio.run(main())
    wall = time.time() - t0
    hit = _smoothed_crossing(records, target, window)
    to_target = None if hit is None else records[hit["index"]]["time_s"]
    k = max(1, len(records) // 10)
    rewards = [r["critic/rewards/mean"] for r in records]
    return {
        "mode": "plain_single_process",
        "steps": len(records),
        "train_loop_s": round(records[-1]["time_s"], 2) if records else None,
        "wall_s": round(wall, 2),
        "time_to_target_s": to_target,
        "target_hit": hit,
        "reward_first_10pct": sum(rewards[:k]) / k,
        "reward_last_10pct": sum(rewards[-k:]) / k,
        "phases_s": {
            "generation": round(sum(r["timing/gen_s"] for r in records), 2),
            "step_total": round(sum(r["timing/step_s"] for r in records), 2),
        },
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def run_benchmark(
    *, overrides: list[str], target: float = 0.5, window: int = 5, modes: tuple[str, ...] = ("fully_async", "sync"),
    baseline: bool = True, out_dir: str | None = None,
) -> dict[str, Any]:
    from meshrl.train import ensure_model, resolve_config

    root = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="meshrl-bench-e2e-"))
    root.mkdir(parents=True, exist_ok=True)
    cases: dict[str, Any] = {}
    for mode in modes:
        cases[mode] = _mesh_case(mode, overrides, target, window, root)
    if baseline:
        cfg = ensure_model(resolve_config(None, overrides, mode="sync"))
        cases["plain"] = _baseline_case(cfg, target, window, root)
    result: dict[str, Any] = {
        "benchmark": "e2e",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}",
        "overrides": overrides,
        "target_reward": target,
        "smoothing_window_steps": window,
        "run_dirs": str(root),
        "cases": cases,
        "ratios": {},
    }
    t = {k: v.get("time_to_target_s") for k, v in cases.items()}
    loop = {k: v.get("train_loop_s") for k, v in cases.items()}
    ratios = result["ratios"]
    if "fully_async" in t and "sync" in t:
        ratios["sync_over_async_time_to_target"] = _ratio(t["sync"], t["fully_async"])
        ratios["sync_over_async_train_loop"] = _ratio(loop["sync"], loop["fully_async"])
    if "plain" in t:
        for mode in modes:
            ratios[f"{mode}_over_plain_time_to_target"] = _ratio(t[mode], t["plain"])
            ratios[f"{mode}_over_plain_per_step"] = _ratio(
                (loop[mode] or 0) / max(1, cases[mode]["steps"]), (loop["plain"] or 0) / max(1, cases["plain"]["steps"])
            )
    return result
