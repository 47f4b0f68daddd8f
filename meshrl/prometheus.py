"""Where Prometheus finds the mesh's metrics: every Ray node's metrics agent serves all the
metrics of the processes on that node (the services' `meshrl_*` families among them, prefixed
`ray_`). `meshrl train` writes them as a Prometheus file service-discovery target list,
`<run_dir>/prometheus_sd.json`, for `file_sd_configs` (examples/grafana/README.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def metrics_targets() -> list[str]:
    """host:port of each live Ray node's metrics endpoint (ray must be initialized)."""
    import ray

    out = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("Alive") and port:
            out.append(f"{node['NodeManagerAddress']}:{port}")
    return sorted(out)


def write_service_discovery(run_dir: Path, labels: dict[str, Any]) -> Path:
    path = run_dir / "prometheus_sd.json"
    path.write_text(json.dumps([{"targets": metrics_targets(), "labels": {k: str(v) for k, v in labels.items()}}],
                               indent=2))
    return path
