"""`meshrl report RUN_DIR [RUN_DIR ...]`: one self-contained report.html from run directories.

A run directory holds `metrics/trainer.jsonl` (one record per trainer step), optionally
`metrics/validation.jsonl`, `metrics/rollout.jsonl`, `config.resolved.yaml` and `summary.json`
(written at the end of a run: mode, staleness histogram, ledger audit, totals). Several run
directories are overlaid (sync and async side by side). The report is written into the first run
directory unless `out` is given; its plots are embedded as PNG data URIs, so the one file can be
mailed or attached as it is (meshrl/report_html.py lays out the page).

Metric keys read (the trainer's names; a missing one leaves its plot or row out):
  step, time (unix s), policy_version, critic/rewards/mean, val/score, val-core/*, staleness/mean,
  perf/throughput_tokens_per_s, perf/idle_ratio (trainer), rollout/idle_ratio, timing_s/publish,
  and agent metrics (AGENT_KEYS) when a run has them.
Wall time on the x axis is seconds since the run started (summary.json's started_unix_s, or the
first record when that is earlier: a resumed run), from each record's `time`.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLOTS: list[tuple[str, str, str]] = [
    # (title, metric key, y label)
    ("reward", "critic/rewards/mean", "reward (mean)"),
    ("validation score", "val/score", "validation score"),
    ("trained tokens/s", "perf/throughput_tokens_per_s", "trained tokens / s"),
    ("trainer idle", "perf/idle_ratio", "trainer idle ratio"),
    ("rollout idle", "rollout/idle_ratio", "rollout idle ratio"),
    ("weight sync", "timing_s/publish", "weight publish (s)"),
    ("staleness", "staleness/mean", "staleness (versions, mean)"),
]

AGENT_PREFIXES = ("agent/", "multi_turn/", "tool/")
"""Metric key prefixes of multi-turn / agent runs (turns per trajectory, tool-call rate, ...)."""
AGENT_KEYS = ("num_turns/mean", "turns/mean", "tool_calls/rate", "tool_call_rate")
"""Exact agent metric keys outside those prefixes."""


def is_agent_key(key: str) -> bool:
    return key.startswith(AGENT_PREFIXES) or key in AGENT_KEYS


@dataclass
class Run:
    path: Path
    label: str
    steps: list[dict[str, Any]]
    validation: list[dict[str, Any]]
    summary: dict[str, Any]
    rollout: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)


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
    import yaml

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{p} is not a run directory")
    summary = json.loads((p / "summary.json").read_text()) if (p / "summary.json").exists() else {}
    config = yaml.safe_load((p / "config.resolved.yaml").read_text()) if (p / "config.resolved.yaml").exists() else {}
    mode = summary.get("mode", "")
    label = f"{p.name} ({mode})" if mode else p.name
    steps = _jsonl(p / "metrics" / "trainer.jsonl")
    validation = _jsonl(p / "metrics" / "validation.jsonl")
    rollout = _jsonl(p / "metrics" / "rollout.jsonl")
    # One clock for every file: summary.json is the last session's, so after a resume records older
    # than its start exist (and the services' own time_s restarted at 0 with each session).
    times = [rec["time"] for rec in (*steps, *validation, *rollout) if isinstance(rec.get("time"), int | float)]
    starts = [t for t in (summary.get("started_unix_s"), min(times, default=None)) if t is not None]
    start = min(starts) if starts else None
    for rec in (*steps, *validation, *rollout):
        if start is not None and isinstance(rec.get("time"), int | float):
            rec["time_s"] = rec["time"] - start
        if "step" not in rec and "policy_version" in rec:
            rec["step"] = rec["policy_version"]  # validation records: x = policy version
    return Run(p, label, steps, validation, summary, rollout, config or {})


def records_for(run: Run, key: str) -> list[dict[str, Any]]:
    if key.startswith(("val/", "val-core/", "val-aux/")):
        return run.validation
    if key.startswith("rollout/"):
        return run.rollout
    return run.steps


def series(records: list[dict[str, Any]], key: str, x: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        if r.get(key) is not None and r.get(x) is not None:
            xs.append(float(r[x]))
            ys.append(float(r[key]))
    return xs, ys


@dataclass(frozen=True)
class Plot:
    title: str
    data_uri: str
    """`data:image/png;base64,...`: the page needs no file beside it."""


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _line_plots(runs: list[Run], title: str, key: str, ylabel: str) -> list[Plot]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    is_val = key.startswith(("val/", "val-core/"))
    xs_available = (("time_s", "wall time (s)"),) if key.startswith("rollout/") else (
        ("step", "policy version" if is_val else "trainer step"), ("time_s", "wall time (s)"))
    for x, xlabel in xs_available:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        drawn = False
        for run in runs:
            xs, ys = series(records_for(run, key), key, x)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=run.label)
                drawn = True
        if drawn:
            ax.set_title(f"{title} by {'wall time' if x == 'time_s' else xlabel}", fontsize=10)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            out.append(Plot(f"{title} by {'wall time' if x == 'time_s' else xlabel}", _png(fig)))
        plt.close(fig)
    return out


def _histogram(runs: list[Run]) -> list[Plot]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hists = [(r.label, staleness_histogram(r)) for r in runs]
    hists = [(label, h) for label, h in hists if h]
    if not hists:
        return []
    fig, ax = plt.subplots(figsize=(6, 3.4))
    width = 0.8 / len(hists)
    for i, (label, h) in enumerate(hists):
        keys = sorted(h)
        ax.bar([k + i * width for k in keys], [h[k] for k in keys], width=width, label=label)
    ax.set_title("staleness at consumption", fontsize=10)
    ax.set_xlabel("staleness (versions)")
    ax.set_ylabel("groups")
    ax.legend(fontsize=7)
    fig.tight_layout()
    plot = Plot("staleness histogram", _png(fig))
    plt.close(fig)
    return [plot]


def staleness_histogram(run: Run) -> dict[int, int]:
    return {int(k): int(v) for k, v in run.summary.get("staleness_histogram", {}).items()}


def agent_keys(runs: list[Run]) -> list[str]:
    return sorted({k for run in runs for rec in run.steps for k in rec if is_agent_key(k)})


def val_core_keys(runs: list[Run]) -> list[str]:
    return sorted({k for run in runs for rec in run.validation for k in rec if k.startswith("val-core/")})


def make_plots(runs: list[Run]) -> list[Plot]:
    plots: list[Plot] = []
    for title, key, ylabel in PLOTS:
        plots += _line_plots(runs, title, key, ylabel)
    plots += _histogram(runs)
    for key in val_core_keys(runs):
        plots += _line_plots(runs, key.removeprefix("val-core/"), key, "score")[:1]  # by policy version
    for key in agent_keys(runs):
        plots += _line_plots(runs, key, key, key)[:1]
    return plots


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write report.html (self-contained); returns its path."""
    from meshrl.report_html import render

    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise ValueError("no run directories given")
    out_dir = Path(out) if out else runs[0].path
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "report.html"
    report.write_text(render(runs, make_plots(runs)))
    return report
