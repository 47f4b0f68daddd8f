"""The param server's Prometheus families (services/common/metrics.py), from its store and its
transfer counters (bytes through the grpc transport; the others carry bytes elsewhere)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.metrics import Family, ReplicaMetrics

if TYPE_CHECKING:
    from .servicer import ParamServerServicer

FAMILIES = (
    Family("meshrl_param_server_bytes_in", "Weight bytes received from publishers (grpc transport).", "counter"),
    Family("meshrl_param_server_bytes_out", "Weight bytes sent to rollouts (grpc transport).", "counter"),
    Family("meshrl_param_server_publishes", "Versions published.", "counter"),
    Family("meshrl_param_server_fetches", "Fetches served.", "counter"),
    Family("meshrl_param_server_publish_seconds", "Seconds the last publish took (first byte to verified)."),
    Family("meshrl_param_server_fetch_seconds", "Seconds the last fetch took."),
    Family("meshrl_param_server_versions_held", "Versions the store holds."),
    Family("meshrl_param_server_newest_version", "The newest version held."),
    Family("meshrl_param_server_bytes_held", "Host bytes of the versions held."),
)


def export(m: ReplicaMetrics, servicer: ParamServerServicer) -> None:
    c, store = servicer.counters, servicer.store
    m.count_to("meshrl_param_server_bytes_in", c.bytes_in)
    m.count_to("meshrl_param_server_bytes_out", c.bytes_out)
    m.count_to("meshrl_param_server_publishes", c.publishes)
    m.count_to("meshrl_param_server_fetches", c.fetches)
    m.set("meshrl_param_server_publish_seconds", c.last_publish_s)
    m.set("meshrl_param_server_fetch_seconds", c.last_fetch_s)
    m.set("meshrl_param_server_versions_held", len(store.versions()))
    newest = store.newest_version()
    m.set("meshrl_param_server_newest_version", -1 if newest is None else newest)
    m.set("meshrl_param_server_bytes_held", store.bytes_held)
