"""Every Prometheus family the mesh exports, as Ray's endpoint names them (prefix `ray_`,
counters with `_total`, histograms with `_bucket`)."""

from __future__ import annotations

from services.common.metrics import Family
from services.coordinator.metrics import FAMILIES as COORDINATOR
from services.param_server.metrics import FAMILIES as PARAM_SERVER
from services.rollout.metrics import FAMILIES as ROLLOUT
from services.trainer.metrics import FAMILIES as TRAINER

REWARD = (
    Family("meshrl_reward_items", "", "counter"),
    Family("meshrl_reward_items_failed", "", "counter"),
    Family("meshrl_reward_abandoned_threads", ""),
)
"""The reward families a run without external endpoints exports (services/reward/deployment.py)."""

ALL = (*COORDINATOR, *ROLLOUT, *TRAINER, *PARAM_SERVER, *REWARD)


def scraped_name(f: Family) -> str:
    suffix = {"counter": "_total", "histogram": "_bucket"}.get(f.kind, "")
    return f"ray_{f.name}{suffix}"
