"""Integration fixtures: one local Ray + Serve (gRPC ingress on a free port) per test session."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def serve_grpc_port() -> Iterator[int]:
    """Ray (4 logical CPUs, so several small replicas fit on 2 cores) + Serve with the gRPC
    ingress for every meshrl service. Yields the ingress port."""
    import ray
    from ray import serve

    from services.common.serve_util import init_ray, start_serve

    port = free_port()
    init_ray(num_cpus=4)
    start_serve(port, http_port=free_port())
    yield port
    serve.shutdown()
    ray.shutdown()
