"""The services' Prometheus exports (services/*/metrics.py) over a fake of ray.util.metrics:
gauges follow the status, counters grow by what is new (and exist at 0 from the first export),
histograms observe each new group once."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest

from meshrl.v1 import rollout_pb2
from services.common.metrics import ReplicaMetrics
from services.coordinator import metrics as coordinator_metrics
from services.coordinator.core import Status, Totals
from services.rollout.metrics import FAMILIES as ROLLOUT
from services.rollout.metrics import RolloutExporter

pytestmark = pytest.mark.unit


class FakeMetric:
    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = (),
                 boundaries: list[float] | None = None) -> None:
        self.name = name
        self.values: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)
        self.observed: list[float] = []

    def _key(self, tags: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((tags or {}).items()))

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[self._key(tags)] = value

    def inc(self, value: float, tags: dict[str, str] | None = None) -> None:
        assert value > 0  # as Ray's Counter.inc
        self.values[self._key(tags)] += value

    def _record(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[self._key(tags)] += value

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.observed.append(value)

    def set_default_tags(self, tags: dict[str, str]) -> None:
        pass


class FakeBackend:
    Gauge = Counter = Histogram = FakeMetric


@dataclass
class FakeStatus:
    queued: int = 3
    in_flight: int = 5
    retry_pending: int = 0
    policy_version: int = 2
    budget_used: int = 6
    max_required_samples: int = 8
    totals: Totals = field(default_factory=Totals)
    histogram: dict[int, int] = field(default_factory=dict)


def value(m: ReplicaMetrics, name: str, **tags: str) -> float:
    return m._m[name].values[tuple(sorted(tags.items()))]


def test_coordinator_export() -> None:
    m = ReplicaMetrics(coordinator_metrics.FAMILIES, backend=FakeBackend)
    st = FakeStatus(totals=Totals(leases_granted=10, consumed=4, regenerated=1), histogram={0: 3, 1: 1})
    coordinator_metrics.export(m, st, {"lost": [], "duplicated": []})  # type: ignore[arg-type]
    assert value(m, "meshrl_coordinator_queue_depth") == 3
    assert value(m, "meshrl_coordinator_budget_use_ratio") == 0.75
    assert value(m, "meshrl_coordinator_leases_granted") == 10
    assert value(m, "meshrl_coordinator_requeued", reason="stale") == 1
    assert value(m, "meshrl_coordinator_requeued", reason="expired") == 0  # exists at 0
    assert value(m, "meshrl_coordinator_prompts_lost") == 0
    assert sorted(m._m["meshrl_coordinator_staleness"].observed) == [0, 0, 0, 1]
    st2 = FakeStatus(totals=Totals(leases_granted=15, consumed=4, regenerated=1, leases_expired=2),
                     histogram={0: 4, 1: 1, 2: 1})
    coordinator_metrics.export(m, st2, None)  # type: ignore[arg-type]
    assert value(m, "meshrl_coordinator_leases_granted") == 15  # grew by 5, not 15
    assert value(m, "meshrl_coordinator_requeued", reason="expired") == 2
    assert sorted(m._m["meshrl_coordinator_staleness"].observed) == [0, 0, 0, 0, 1, 2]  # the new ones once
    # the real Status has every field the export reads
    assert {"queued", "in_flight", "retry_pending", "policy_version", "budget_used", "max_required_samples",
            "totals", "histogram"} <= set(Status.__dataclass_fields__)


def test_rollout_export_rates_and_lag() -> None:
    m = ReplicaMetrics(ROLLOUT, backend=FakeBackend)
    ex = RolloutExporter(m, "r0")
    base: dict[str, Any] = {"tokens_generated": 100, "groups_submitted": 2, "groups_in_flight": 4, "policy_version": 3,
                            "last_weight_load_s": 0.5, "uptime_s": 10.0, "busy_s": 5.0}
    ex.export(rollout_pb2.GetRolloutStatusResponse(**base), {"kv_cache_usage": 0.4}, 5)
    assert value(m, "meshrl_rollout_version_lag", replica="r0") == 2
    assert value(m, "meshrl_rollout_kv_cache_usage", replica="r0") == 0.4
    ex.export(rollout_pb2.GetRolloutStatusResponse(**{**base, "tokens_generated": 300, "uptime_s": 14.0, "busy_s": 8.0}), {}, None)
    assert value(m, "meshrl_rollout_tokens_per_s", replica="r0") == 50.0
    assert value(m, "meshrl_rollout_idle_ratio", replica="r0") == 0.25
    assert value(m, "meshrl_rollout_tokens_generated", replica="r0") == 300
    assert value(m, "meshrl_rollout_version_lag", replica="r0") == 0
