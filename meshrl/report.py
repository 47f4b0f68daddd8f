"""`meshrl report RUN_DIR [RUN_DIR ...]`: plots and report.html from a run directory's metrics.

A run directory holds `metrics/trainer.jsonl` (one record per optimizer step), optionally
`metrics/validation.jsonl` and `summary.json` (written at the end of a run: mode, staleness
histogram, ledger audit, totals). Several run directories are overlaid (sync and async side by
side). The report is written into the first run directory unless `out` is given.

Metric keys read (the trainer's names; missing ones simply leave their plot out):
  step, time (unix s), policy_version, critic/rewards/mean, val/score, staleness/mean,
  perf/throughput_tokens_per_s, perf/idle_ratio (trainer), rollout/idle_ratio, timing_s/publish,
  agent/tool_call_rate, agent/num_turns/mean, agent/tool_error_rate (multi-turn runs)
Wall time on the x axis is seconds since the run started (summary.json's started_unix_s, else the
first record).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLOTS: list[tuple[str, str, str]] = [
    # (file stem, metric key, y label)
    ("reward", "critic/rewards/mean", "reward (mean)"),
    ("val_score", "val/score", "validation score"),
    ("tokens_per_s", "perf/throughput_tokens_per_s", "trained tokens / s"),
    ("trainer_idle", "perf/idle_ratio", "trainer idle ratio"),
    ("rollout_idle", "rollout/idle_ratio", "rollout idle ratio"),
    ("weight_sync", "timing_s/publish", "weight publish (s)"),
    ("staleness_mean", "staleness/mean", "staleness (versions, mean)"),
    # multi-turn runs (agents): how the policy uses its tools
    ("tool_call_rate", "agent/tool_call_rate", "trajectories calling a tool"),
    ("turns", "agent/num_turns/mean", "assistant turns per trajectory"),
    ("tool_errors", "agent/tool_error_rate", "tool calls answered with an error"),
]


@dataclass
class Run:
    path: Path
    label: str
    steps: list[dict[str, Any]]
    validation: list[dict[str, Any]]
    summary: dict[str, Any]
    rollout: list[dict[str, Any]] = field(default_factory=list)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write
    return out


def load_run(path: str | Path) -> Run:
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{p} is not a run directory")
    summary = json.loads((p / "summary.json").read_text()) if (p / "summary.json").exists() else {}
    mode = summary.get("mode", "")
    label = f"{p.name} ({mode})" if mode else p.name
    steps = _jsonl(p / "metrics" / "trainer.jsonl")
    validation = _jsonl(p / "metrics" / "validation.jsonl")
    rollout = _jsonl(p / "metrics" / "rollout.jsonl")
    start = summary.get("started_unix_s") or (steps[0].get("time") if steps else None)
    for rec in (*steps, *validation, *rollout):
        if "time_s" not in rec and start is not None and "time" in rec:
            rec["time_s"] = rec["time"] - start
        if "step" not in rec and "policy_version" in rec:
            rec["step"] = rec["policy_version"]  # validation records: x = policy version
    return Run(p, label, steps, validation, summary, rollout)


def _series(records: list[dict[str, Any]], key: str, x: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        if key in r and x in r and r[key] is not None:
            xs.append(float(r[x]))
            ys.append(float(r[key]))
    return xs, ys


def _plot(runs: list[Run], stem: str, key: str, ylabel: str, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    xs_available = (("time_s", "wall time (s)"),) if key.startswith("rollout/") else (
        ("step", "policy version" if key.startswith("val/") else "trainer step"), ("time_s", "wall time (s)"))
    for x, xlabel in xs_available:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        drawn = False
        for run in runs:
            records = run.validation if key.startswith("val/") else run.rollout if key.startswith("rollout/") else run.steps
            xs, ys = _series(records, key, x)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=run.label)
                drawn = True
        if drawn:
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            name = f"{stem}_by_{'step' if x == 'step' else 'time'}.png"
            fig.savefig(out / name, dpi=110)
            written.append(name)
        plt.close(fig)
    return written


def _histogram(runs: list[Run], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hists = [(r.label, {int(k): int(v) for k, v in r.summary.get("staleness_histogram", {}).items()}) for r in runs]
    hists = [(label, h) for label, h in hists if h]
    if not hists:
        return []
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / len(hists)
    for i, (label, h) in enumerate(hists):
        keys = sorted(h)
        ax.bar([k + i * width for k in keys], [h[k] for k in keys], width=width, label=label)
    ax.set_xlabel("staleness at consumption (versions)")
    ax.set_ylabel("groups")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "staleness_histogram.png", dpi=110)
    plt.close(fig)
    return ["staleness_histogram.png"]


def _summary_rows(run: Run) -> list[tuple[str, str]]:
    rows = []
    rewards = [r["critic/rewards/mean"] for r in run.steps if r.get("critic/rewards/mean") is not None]
    if rewards:
        k = max(1, len(rewards) // 10)
        rows.append(("reward, first 10% of steps", f"{sum(rewards[:k]) / k:.3f}"))
        rows.append(("reward, last 10% of steps", f"{sum(rewards[-k:]) / k:.3f}"))
    for key, name in (("agent/tool_call_rate", "tool-call rate"), ("agent/num_turns/mean", "turns per trajectory")):
        values = [r[key] for r in run.steps if r.get(key) is not None]
        if values:
            k = max(1, len(values) // 10)
            rows.append((f"{name}, first / last 10% of steps", f"{sum(values[:k]) / k:.3f} / {sum(values[-k:]) / k:.3f}"))
    if run.steps:
        rows.append(("optimizer steps", str(len(run.steps))))
        rows.append(("wall time (s)", f"{run.steps[-1].get('time_s', float('nan')):.1f}"))
    for key in ("mode", "policy_versions", "max_staleness_seen", "audit", "totals"):
        if key in run.summary:
            rows.append((key, json.dumps(run.summary[key])))
    return rows


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write plots and report.html; returns the report's path."""
    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise ValueError("no run directories given")
    out_dir = Path(out) if out else runs[0].path
    plots_dir = out_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    images: list[str] = []
    for stem, key, ylabel in PLOTS:
        images += _plot(runs, stem, key, ylabel, plots_dir)
    images += _histogram(runs, plots_dir)
    parts = ["<html><head><meta charset='utf-8'><title>meshrl report</title>",
             "<style>body{font-family:sans-serif;margin:2em}img{max-width:48%;margin:0.5%}"
             "td{padding:2px 10px;border-bottom:1px solid #ddd;font-size:13px}</style></head><body>",
             "<h1>meshrl report</h1>"]
    for run in runs:
        parts.append(f"<h2>{html.escape(run.label)}</h2><table>")
        parts += [f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in _summary_rows(run)]
        parts.append("</table>")
    parts += [f"<img src='plots/{name}' alt='{name}'>" for name in images]
    parts.append("</body></html>")
    report = out_dir / "report.html"
    report.write_text("\n".join(parts))
    return report
