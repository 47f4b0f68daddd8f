"""Prometheus metrics of a Serve replica through Ray's metrics (`ray.util.metrics`): every node's
metrics agent serves them on Ray's metrics export port (names prefixed `ray_`), so one scrape
config covers the whole mesh (examples/grafana/meshrl.json is a dashboard of them).

The services keep cumulative numbers in their cores (status dicts); `ReplicaMetrics` turns them
into metrics: gauges are set, counters are advanced by the growth since the last export (a
counter never goes back; a restarted replica starts from zero as Prometheus expects), histograms
observe what is new. `export_periodically` runs one service's export on its replica's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.logging import get_logger

log = get_logger(__name__)

DEFAULT_EXPORT_INTERVAL_S = 5.0


@dataclass(frozen=True)
class Family:
    """One metric family: `kind` gauge, counter or histogram; `boundaries` for histograms."""

    name: str
    description: str
    kind: str = "gauge"
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()


class ReplicaMetrics:
    """The families of one replica. Call `set`, `count_to` and `observe` from one thread."""

    def __init__(self, families: Sequence[Family], *, default_tags: Mapping[str, str] | None = None,
                 backend: Any = None) -> None:
        """`backend`: the module with Gauge, Counter and Histogram (ray.util.metrics; unit tests
        pass a fake of the same shape)."""
        if backend is None:
            from ray.util import metrics as backend
        metrics = backend

        self.families = {f.name: f for f in families}
        self._m: dict[str, Any] = {}
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        base = tuple(default_tags or {})
        for f in families:
            keys = (*base, *f.tag_keys)
            if f.kind == "gauge":
                m: Any = metrics.Gauge(f.name, f.description, tag_keys=keys)
            elif f.kind == "counter":
                m = metrics.Counter(f.name, f.description, tag_keys=keys)
            elif f.kind == "histogram":
                assert f.boundaries, f"histogram {f.name} needs boundaries"
                m = metrics.Histogram(f.name, f.description, boundaries=list(f.boundaries), tag_keys=keys)
            else:
                raise AssertionError(f"unknown metric kind {f.kind!r} of {f.name}")
            if default_tags:
                m.set_default_tags(dict(default_tags))
            self._m[f.name] = m

    def set(self, name: str, value: float, tags: Mapping[str, str] | None = None) -> None:
        self._m[name].set(float(value), tags=dict(tags) if tags else None)

    def count_to(self, name: str, total: float, tags: Mapping[str, str] | None = None) -> None:
        """Advance counter `name` to the cumulative `total` (growth since the last call)."""
        key = (name, tuple(sorted((tags or {}).items())))
        first = key not in self._last
        delta = float(total) - self._last.get(key, 0.0)
        if delta > 0:
            self._m[name].inc(delta, tags=dict(tags) if tags else None)
            self._last[key] = float(total)
        elif first:
            # A counter should exist at 0 from the start (rate() and alerts on "lost > 0" then
            # see it); Ray's public inc() refuses 0, its _record takes it.
            record = getattr(self._m[name], "_record", None)
            if record is not None:
                record(0.0, tags=dict(tags) if tags else None)
            self._last[key] = 0.0

    def observe(self, name: str, value: float, times: int = 1, tags: Mapping[str, str] | None = None) -> None:
        for _ in range(max(0, times)):
            self._m[name].observe(float(value), tags=dict(tags) if tags else None)

    def observe_counts(self, name: str, counts: Mapping[int, int]) -> None:
        """Histogram `name` from cumulative counts per value ({staleness: groups}): observe what
        is new since the last call."""
        for value, total in counts.items():
            key = (name, (("value", str(value)),))
            new = int(total) - int(self._last.get(key, 0))
            if new > 0:
                self.observe(name, float(value), times=new)
                self._last[key] = float(total)


def export_periodically(
    name: str, export: Callable[[], Any], *, interval_s: float = DEFAULT_EXPORT_INTERVAL_S
) -> asyncio.Task[None]:
    """Run `export` (sync, or returning an awaitable) every `interval_s` on the running loop until
    the task is cancelled. A failing export logs once per failure streak and keeps going: metrics
    must never take a replica down."""

    async def loop() -> None:
        failing = False
        while True:
            try:
                result = export()
                if asyncio.iscoroutine(result):
                    await result
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 -- metrics are best effort; logged once per streak
                if not failing:
                    log.warning("metrics_export_failed", service=name, error=f"{type(exc).__name__}: {exc}")
                failing = True
            await asyncio.sleep(interval_s)

    return asyncio.get_running_loop().create_task(loop())
