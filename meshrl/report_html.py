"""The page of report.html: per run, a summary, the key config, validation per data_source, the
ledger audit, staleness and idle summaries and agent metrics (when the run has them) as tables,
then the plots (data URIs). Everything is escaped; no script, no external resource."""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any

from meshrl.report import Plot, Run, agent_keys, is_agent_key, staleness_histogram

KEY_CONFIG: list[tuple[str, str]] = [
    # (label, dotted path in config.resolved.yaml)
    ("model", "actor_rollout_ref.model.path"),
    ("advantage estimator", "algorithm.adv_estimator"),
    ("mode", "async_training.mode"),
    ("staleness_threshold", "async_training.staleness_threshold"),
    ("trigger_parameter_sync_step", "async_training.trigger_parameter_sync_step"),
    ("max_staleness_versions", "async_training.max_staleness_versions"),
    ("partial_rollout", "async_training.partial_rollout"),
    ("rollout engine", "actor_rollout_ref.rollout.name"),
    ("samples per prompt (rollout.n)", "actor_rollout_ref.rollout.n"),
    ("trainer engine", "actor_rollout_ref.actor.strategy"),
    ("ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("learning rate", "actor_rollout_ref.actor.optim.lr"),
    ("loss_agg_mode", "actor_rollout_ref.actor.loss_agg_mode"),
    ("max prompt / response length", "data.max_prompt_length|data.max_response_length"),
    ("total_rollout_steps (prompts)", "rollout.total_rollout_steps"),
    ("trainer devices", "trainer.nnodes*trainer.n_gpus_per_node"),
    ("rollout devices", "rollout.nnodes*rollout.n_gpus_per_node"),
    ("weight transport", "actor_rollout_ref.rollout.checkpoint_engine.backend"),
    ("project / experiment", "trainer.project_name|trainer.experiment_name"),
    ("logger", "trainer.logger"),
]

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1250px;color:#222;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em} h2{margin-top:1.6em;border-bottom:2px solid #ccd;padding-bottom:.2em}
h3{margin:1.2em 0 .4em;font-size:1.05em;color:#334}
table{border-collapse:collapse;margin:.3em 0 1em;font-size:13px}
th,td{padding:3px 10px;border-bottom:1px solid #e3e3e8;text-align:left;vertical-align:top}
th{background:#f3f4f8} td.num{text-align:right;font-variant-numeric:tabular-nums}
.grid{display:flex;flex-wrap:wrap;gap:1.5em;align-items:flex-start} .ok{color:#17803d;font-weight:600} .bad{color:#b42318;font-weight:600}
.note{color:#667;font-size:13px} figure{margin:0 0 1em;width:600px;max-width:100%} figure img{width:100%}
figcaption{font-size:12px;color:#556}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _num(x: Any, digits: int = 3) -> str:
    if isinstance(x, bool) or x is None:
        return "-" if x is None else str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:,.{digits}f}" if abs(x) < 1e6 else f"{x:,.0f}"
    try:
        return f"{int(str(x)):,}"
    except ValueError:
        return str(x)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, numeric_from: int = 1) -> str:
    """An HTML table; cells from column `numeric_from` on that are numbers are right-aligned."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, v in enumerate(row):
            numeric = i >= numeric_from and isinstance(v, int | float) and not isinstance(v, bool)
            cells.append(f"<td class='num'>{_e(_num(v))}</td>" if numeric else f"<td>{_e(v)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _get(cfg: dict[str, Any], path: str) -> Any:
    cur: Any = cfg
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def key_config_rows(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for label, spec in KEY_CONFIG:
        if "*" in spec:
            a, b = (_get(cfg, p) for p in spec.split("*"))
            value: Any = a * b if isinstance(a, int) and isinstance(b, int) else None
        elif "|" in spec:
            parts = [_get(cfg, p) for p in spec.split("|")]
            value = " / ".join(str(v) for v in parts) if any(v is not None for v in parts) else None
        else:
            value = _get(cfg, spec)
        if isinstance(value, list):
            value = ", ".join(str(v) for v in value)
        if value is not None:
            rows.append((label, str(value)))
    return rows


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _values(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)]


def summary_rows(run: Run) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    s = run.summary
    # summary.json's `steps` are trainer steps (each require_batches x ppo_epochs optimizer steps)
    for label, key in (("mode", "mode"), ("trainer steps", "steps"), ("policy versions", "policy_versions"),
                       ("wall time (s)", "wall_s")):
        if s.get(key) is not None:
            rows.append((label, s[key]))
    if "steps" not in s and run.steps:
        rows.append(("trainer steps", len(run.steps)))
    optimizer_steps = _values(run.steps, "training/optimizer_steps")
    if optimizer_steps:
        rows.append(("optimizer steps", int(optimizer_steps[-1])))
    rewards = _values(run.steps, "critic/rewards/mean")
    if rewards:
        k = max(1, len(rewards) // 10)
        rows.append(("reward, first 10% of steps", sum(rewards[:k]) / k))
        rows.append(("reward, last 10% of steps", sum(rewards[-k:]) / k))
    val = _values(run.validation, "val/score")
    if val:
        rows.append(("validation score, last", val[-1]))
        rows.append(("validation score, best", max(val)))
    return rows


def audit_html(run: Run) -> str:
    audit = run.summary.get("audit")
    if not isinstance(audit, dict):
        return "<p class='note'>No ledger audit (the run did not finish, or predates summary.json).</p>"
    balanced = bool(audit.get("balanced"))
    verdict = ("<p class='ok'>Balanced: every prompt issued was trained on exactly once.</p>" if balanced
               else "<p class='bad'>NOT balanced: see lost / duplicated below and the ledger.</p>")
    audit_rows = [(k.replace("_", " "), v) for k, v in audit.items() if k != "balanced"]
    totals = run.summary.get("totals") or {}
    total_rows = [(k.replace("_", " "), v) for k, v in totals.items()]
    return verdict + "<div class='grid'>" + table(["ledger", "prompts"], audit_rows) + (
        table(["coordinator totals", ""], total_rows) if total_rows else "") + "</div>"


def staleness_html(run: Run) -> str:
    hist = staleness_histogram(run)
    if not hist:
        means = _values(run.steps, "staleness/mean")
        return table(["staleness", "versions"], [("mean over steps", _mean(means))]) if means else ""
    groups = sum(hist.values())
    mean = sum(k * v for k, v in hist.items()) / groups if groups else 0.0
    rows: list[tuple[str, Any]] = [("groups trained", groups), ("mean (versions)", mean), ("max (versions)", max(hist))]
    rows += [(f"groups at staleness {k}", f"{hist[k]:,} ({100 * hist[k] / groups:.1f}%)") for k in sorted(hist)]
    return table(["staleness at consumption", ""], rows)


def idle_html(run: Run) -> str:
    rows: list[tuple[str, Any, Any]] = []
    for label, records, key in (("trainer idle ratio (waiting for data)", run.steps, "perf/idle_ratio"),
                                ("rollout idle ratio", run.rollout, "rollout/idle_ratio"),
                                ("trainer step (s)", run.steps, "timing_s/step"),
                                ("weight publish (s)", run.steps, "timing_s/publish"),
                                ("rollout weight load (s)", run.rollout, "rollout/weight_load_s"),
                                ("trained tokens/s", run.steps, "perf/throughput_tokens_per_s"),
                                ("generated tokens/s (one replica)", run.rollout, "rollout/tokens_per_s")):
        vals = _values(records, key)
        if vals:
            half = vals[len(vals) // 2:]
            rows.append((label, _mean(vals), _mean(half)))
    if not rows:
        return ""
    return table(["time and idleness", "mean", "mean, second half"], rows)


def split_val_key(key: str) -> tuple[str, str, str]:
    """`val-core/openai/gsm8k/acc/best@4/mean` -> (`openai/gsm8k`, `acc`, `best@4/mean`): the data
    source may hold slashes, the metric is the last part with an `@` and what follows it."""
    parts = key.split("/")[1:]
    at = max((i for i, p in enumerate(parts) if "@" in p), default=len(parts) - 1)
    return "/".join(parts[: at - 1]), parts[at - 1] if at >= 1 else "", "/".join(parts[at:])


def validation_html(run: Run) -> str:
    """val-core/<data_source>/<var>/<metric> as rows: data source, variable, metric, first, last, best."""
    keys = sorted({k for r in run.validation for k in r if k.startswith("val-core/")})
    if not keys:
        return "<p class='note'>No validation in this run (trainer.test_freq &le; 0, or no validation data).</p>"
    rows = []
    for key in keys:
        source, var, metric = split_val_key(key)
        pts = [(r.get("policy_version"), float(r[key])) for r in run.validation if r.get(key) is not None]
        best = max(pts, key=lambda p: p[1])
        rows.append((source, var, metric, pts[0][1], pts[-1][1], best[1], best[0]))
    return table(["data source", "variable", "metric", "first", "last", "best", "best at version"], rows,
                 numeric_from=3)


def agent_html(run: Run) -> str:
    keys = sorted({k for r in run.steps for k in r if is_agent_key(k)})
    if not keys:
        return ""
    rows = []
    for key in keys:
        vals = _values(run.steps, key)
        if vals:
            rows.append((key, _mean(vals), vals[-1]))
    return "<h3>Agent metrics</h3>" + table(["metric", "mean over steps", "last"], rows)


def render(runs: list[Run], plots: list[Plot]) -> str:
    title = "meshrl report: " + ", ".join(r.path.name for r in runs)
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>",
             f"<meta name='viewport' content='width=device-width'><style>{CSS}</style></head><body>",
             "<h1>meshrl report</h1>",
             f"<p class='note'>{len(runs)} run(s): " + ", ".join(_e(r.label) for r in runs) + "</p>"]
    agents_anywhere = bool(agent_keys(runs))
    for run in runs:
        parts.append(f"<h2>{_e(run.label)}</h2><p class='note'>{_e(run.path)}</p><div class='grid'>")
        parts.append("<div><h3>Summary</h3>" + table(["", ""], summary_rows(run)) + "</div>")
        cfg_rows = key_config_rows(run.config)
        if cfg_rows:
            parts.append("<div><h3>Key config</h3>" + table(["setting", "value"], cfg_rows, numeric_from=9) + "</div>")
        parts.append("</div><h3>Validation per data source</h3>" + validation_html(run))
        parts.append("<h3>Ledger audit</h3>" + audit_html(run))
        parts.append("<div class='grid'><div><h3>Staleness</h3>" + (staleness_html(run) or "<p class='note'>-</p>")
                     + "</div><div><h3>Time and idleness</h3>" + (idle_html(run) or "<p class='note'>-</p>")
                     + "</div></div>")
        if agents_anywhere:
            parts.append(agent_html(run) or "<h3>Agent metrics</h3><p class='note'>None in this run.</p>")
    parts.append("<h2>Plots</h2><div class='grid'>")
    parts += [f"<figure><img src='{p.data_uri}' alt='{_e(p.title)}'><figcaption>{_e(p.title)}</figcaption></figure>"
              for p in plots]
    parts.append("</div></body></html>")
    return "\n".join(parts)
