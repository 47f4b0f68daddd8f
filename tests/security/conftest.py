"""The security tier: plain servers on loopback (one mesh per module), certificates made here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.security import reset_process_security

from .certs import Certs, make_certs


@pytest.fixture(autouse=True)
def _clean_process_security() -> Iterator[None]:
    reset_process_security()
    yield
    reset_process_security()


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def mesh_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mesh")
