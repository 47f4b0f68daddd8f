"""Unit tests run without Ray: any attempt to start or join a Ray cluster fails the test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import ray
    except ImportError:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("unit tests must not start Ray; move this test to tests/integration")

    monkeypatch.setattr(ray, "init", refuse)
