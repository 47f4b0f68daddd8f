"""Integration fixtures (the session's Ray + Serve, `serve_grpc_port`, lives in tests/conftest.py: the
security tier shares it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from services.common.serve_util import free_port  # noqa: F401 -- tests import it from here


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
