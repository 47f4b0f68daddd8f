"""Shared test fixtures. Tier markers are applied by directory: tests/unit -> unit, tests/security ->
security, etc."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MESHRL_LOG_FORMAT", "console")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(ROOT / "tests").parts
        if parts and parts[0] in ("unit", "integration", "e2e", "security"):
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.fixture(scope="session")
def serve_grpc_port() -> Iterator[int]:
    """Ray (4 logical CPUs, so several small replicas fit on 2 cores) + Serve with the gRPC
    ingress for every meshrl service, one per session (the integration and security tiers share
    it). Yields the ingress port."""
    import ray
    from ray import serve

    from services.common.serve_util import free_port, init_ray, start_serve

    port = free_port()
    init_ray(num_cpus=4)
    proxies_ready = start_serve(port, http_port=free_port(), wait_for_proxies=False)  # as `meshrl train` does
    proxies_ready()
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # the gRPC ingress listens once it returns
    yield port
    serve.shutdown()
    ray.shutdown()
