"""Integration fixtures: one local Ray + Serve (gRPC ingress on a free port) per test session."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.serve_util import free_port


@pytest.fixture
def tls_cert(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for `localhost` (cert.pem, key.pem); skips without the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


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
