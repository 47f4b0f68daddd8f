"""`meshrl bench e2e`: wall time to a target reward, fully async vs sync on the same mesh, and the
mesh against the plain single-process loop (meshrl/baseline.py) — same model, data and
hyper-parameters — all measured in one run on one machine.

For every case the reward curve is smoothed with a trailing window (`--window` steps); the time to
target is the trainer clock (seconds from the first optimizer step's start, so Ray/Serve start-up,
a constant, is reported separately) at the first step whose smoothed reward reaches the target
(several targets may be given; the first is the headline). Per-phase seconds come from the
trainer's metrics — training (old_logprob + update_actor), weight sync (publish), trainer idle
(waiting for data), other — and from the rollout replica's counters sampled by the driver:
generation (seconds with a group in flight) and rollout idle.

`--max-train-s` stops each mesh case cleanly that long after its first step (and the plain loop
after the step that crosses it), so a slow mode cannot eat a fixed budget; cases are then
compared per step and by time to target, not by total time. `merge_results` combines cases run
by separate invocations (scripts/gpu/bench_e2e.sh runs each under its own timeout).
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import platform
import tempfile
import time
from collections.abc import Sequence
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


def _times_to_targets(records: list[dict[str, Any]], targets: Sequence[float], window: int,
                      elapsed: Any) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for t in targets:
        hit = _smoothed_crossing(records, t, window)
        out[str(t)] = None if hit is None else round(float(elapsed(hit["index"])), 2)
    return out


def _sum(records: list[dict[str, Any]], *keys: str) -> float:
    return round(sum(float(r.get(k) or 0.0) for r in records for k in keys), 2)


def mesh_phases(steps: list[dict[str, Any]], rollout: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """Per-phase seconds of one mesh run: the trainer's step timings, and the rollout samples that
    end inside the training loop [start, end] (unix seconds)."""
    step_s = _sum(steps, "timing_s/step")
    # timing_s/old_logprob: the name before it became verl's (runs recorded then)
    training = _sum(steps, "timing_s/update_actor", "timing_s/old_log_prob", "timing_s/old_logprob", "timing_s/ref")
    sync = _sum(steps, "timing_s/publish")
    idle = _sum(steps, "timing_s/wait_data")
    inside = [r for r in rollout if start <= r["time"] <= end and "rollout/interval_s" in r]
    interval = sum(r["rollout/interval_s"] for r in inside)
    busy = sum(r["rollout/busy_s"] for r in inside)
    tokens = sum(r["rollout/tokens_per_s"] * r["rollout/interval_s"] for r in inside)
    return {
        "training": training,
        "weight_sync": sync,
        "trainer_idle": idle,
        "trainer_other": round(max(0.0, step_s - training - sync - idle), 2),
        "generation": round(busy, 2),
        "rollout_idle": round(max(0.0, interval - busy), 2),
        "rollout_sampled_s": round(interval, 2),
        "rollout_busy_fraction": round(busy / interval, 3) if interval > 0 else None,
        "rollout_tokens_per_s": round(tokens / interval, 1) if interval > 0 else None,
    }


def _response_lengths(records: list[dict[str, Any]]) -> dict[str, float | None]:
    means = [r["response_length/mean"] for r in records if r.get("response_length/mean") is not None]
    maxes = [r["response_length/max"] for r in records if r.get("response_length/max") is not None]
    return {"mean": round(sum(means) / len(means), 2) if means else None, "max": max(maxes) if maxes else None}


def _mesh_case(config: str | None, mode: str, overrides: list[str], targets: Sequence[float], window: int, root: Path,
               max_train_s: float | None) -> dict[str, Any]:
    from meshrl.train import train

    run_dir = root / mode
    t0 = time.time()
    summary = train(config, [*overrides, "trainer.test_freq=-1"], run_dir=run_dir, mode=mode, report=False,
                    max_train_s=max_train_s)
    wall = time.time() - t0
    steps = _load(run_dir / "metrics" / "trainer.jsonl")
    rollout = _load(run_dir / "metrics" / "rollout.jsonl")
    # The first step's record is written when it ends: its start is time - step duration.
    start = steps[0]["time"] - steps[0]["timing_s/step"] if steps else t0
    end = steps[-1]["time"] if steps else t0
    hit = _smoothed_crossing(steps, targets[0], window)
    loop = round(end - start, 2) if steps else None
    return {
        "mode": mode,
        "steps": len(steps),
        "startup_s": round(start - t0, 2),
        # the first step's end: its batch was generated and its update applied (startup_s is when
        # the trainer began it, its wait for that batch included)
        "first_step_done_s": round(steps[0]["time"] - t0, 2) if steps else None,
        "startup_phases_s": summary.get("startup_s", {}),
        "train_loop_s": loop,
        "per_step_s": round(loop / len(steps), 4) if loop is not None and steps else None,
        "loop_start_unix": start,
        "loop_end_unix": end,
        "wall_s": round(wall, 2),
        "time_to_target_s": None if hit is None else round(steps[hit["index"]]["time"] - start, 2),
        "target_hit": hit,
        "time_to_targets_s": _times_to_targets(steps, targets, window, lambda i: steps[i]["time"] - start),
        "reward_first_10pct": summary["reward_first_10pct"],
        "reward_last_10pct": summary["reward_last_10pct"],
        "response_length": _response_lengths(steps),
        "phases_s": mesh_phases(steps, rollout, start, end),
        "staleness_histogram": summary["staleness_histogram"],
        "audit_balanced": summary["audit"]["balanced"],
    }


def _baseline_case(cfg: MeshConfig, targets: Sequence[float], window: int, root: Path,
                   max_train_s: float | None) -> dict[str, Any]:
    from meshrl.baseline import run_baseline
    from services.reward.local import LocalScorer

    async def main() -> list[dict[str, Any]]:
        scorer = LocalScorer(cfg)
        try:
            path = cfg.actor_rollout_ref.model.path
            assert path is not None
            return await run_baseline(cfg, path, scorer, metrics_path=root / "baseline.jsonl", max_wall_s=max_train_s)
        finally:
            await scorer.close()

    t0 = time.time()
    records = asyncio.run(main())
    wall = time.time() - t0
    hit = _smoothed_crossing(records, targets[0], window)
    k = max(1, len(records) // 10)
    rewards = [r["critic/rewards/mean"] for r in records]
    loop = round(records[-1]["time_s"], 2) if records else None
    return {
        "mode": "plain_single_process",
        "steps": len(records),
        "train_loop_s": loop,
        "per_step_s": round(loop / len(records), 4) if loop is not None and records else None,
        "loop_start_unix": records[0]["time"] - records[0]["time_s"] if records else t0,
        "loop_end_unix": records[-1]["time"] if records else t0,
        "wall_s": round(wall, 2),
        "time_to_target_s": None if hit is None else records[hit["index"]]["time_s"],
        "target_hit": hit,
        "time_to_targets_s": _times_to_targets(records, targets, window, lambda i: records[i]["time_s"]),
        "reward_first_10pct": sum(rewards[:k]) / k if rewards else None,
        "reward_last_10pct": sum(rewards[-k:]) / k if rewards else None,
        "response_length": _response_lengths(records),
        "phases_s": {
            "generation": round(sum(r["timing/gen_s"] for r in records), 2),
            "step_total": round(sum(r["timing/step_s"] for r in records), 2),
        },
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def ratios(cases: dict[str, Any]) -> dict[str, Any]:
    """sync / fully_async and mesh / plain: time to target (each target), per step, train loop."""
    out: dict[str, Any] = {}
    pairs = [("sync", "fully_async")] + [(m, "plain") for m in cases if m != "plain"]
    for num, den in pairs:
        if num not in cases or den not in cases:
            continue
        a, b = cases[num], cases[den]
        prefix = f"{num}_over_{den.replace('fully_', '')}" if den != "plain" else f"{num}_over_plain"
        out[f"{prefix}_time_to_target"] = _ratio(a.get("time_to_target_s"), b.get("time_to_target_s"))
        out[f"{prefix}_per_step"] = _ratio(a.get("per_step_s"), b.get("per_step_s"))
        if a.get("steps") == b.get("steps"):
            out[f"{prefix}_train_loop"] = _ratio(a.get("train_loop_s"), b.get("train_loop_s"))
        ta, tb = a.get("time_to_targets_s") or {}, b.get("time_to_targets_s") or {}
        out[f"{prefix}_time_to_targets"] = {t: _ratio(ta.get(t), tb.get(t)) for t in ta if t in tb}
    return out


def gpu_utilization(csv_path: str | Path, start: float, end: float) -> dict[str, dict[str, float]]:
    """Mean utilization.gpu (%) and max memory.used (MiB) per GPU index over [start, end] (unix s)
    from `nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader,nounits -l 1`."""
    from datetime import datetime

    samples: dict[str, list[tuple[float, float]]] = {}
    with open(csv_path) as f:
        for row in csv.reader(f):
            if len(row) < 4:
                continue
            try:
                ts = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                util, mem = float(row[2]), float(row[3])
            except ValueError:
                continue
            if start <= ts <= end:
                samples.setdefault(row[1].strip(), []).append((util, mem))
    return {
        idx: {"util_mean_pct": round(sum(u for u, _ in v) / len(v), 1), "mem_max_mib": max(m for _, m in v),
              "samples": len(v)}
        for idx, v in sorted(samples.items())
    }


def merge_results(results: Sequence[dict[str, Any]], *, gpu_csv: str | Path | None = None) -> dict[str, Any]:
    """One result from several invocations' results (cases merged, ratios recomputed), with GPU
    utilization per case when an nvidia-smi CSV is given."""
    if not results:
        raise ValueError("nothing to merge: give at least one `meshrl bench e2e` JSON")
    merged = {k: v for k, v in results[0].items() if k not in ("cases", "ratios")}
    merged["cases"] = {}
    for r in results:
        merged["cases"].update(r.get("cases", {}))
    if gpu_csv is not None and Path(gpu_csv).exists():
        for case in merged["cases"].values():
            if case.get("loop_start_unix") is not None:
                case["gpu_utilization"] = gpu_utilization(gpu_csv, case["loop_start_unix"], case["loop_end_unix"])
    merged["ratios"] = ratios(merged["cases"])
    return merged


def run_benchmark(
    *, overrides: list[str], target: float = 0.5, window: int = 5, modes: tuple[str, ...] = ("fully_async", "sync"),
    baseline: bool = True, out_dir: str | None = None, config: str | None = None,
    extra_targets: Sequence[float] = (), max_train_s: float | None = None,
) -> dict[str, Any]:
    from meshrl.train import ensure_model, resolve_config

    targets = [target, *[t for t in extra_targets if t != target]]
    root = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="meshrl-bench-e2e-"))
    root.mkdir(parents=True, exist_ok=True)
    cases: dict[str, Any] = {}
    for mode in modes:
        cases[mode] = _mesh_case(config, mode, overrides, targets, window, root, max_train_s)
    if baseline:
        cfg = ensure_model(resolve_config(config, overrides, mode="sync"))
        cases["plain"] = _baseline_case(cfg, targets, window, root, max_train_s)
    return {
        "benchmark": "e2e",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}",
        "config": config or "built-in example",
        "overrides": overrides,
        "target_reward": target,
        "targets": targets,
        "smoothing_window_steps": window,
        "max_train_s": max_train_s,
        "run_dirs": str(root),
        "cases": cases,
        "ratios": ratios(cases),
    }
