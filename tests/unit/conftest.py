"""Unit tests run without Ray: any attempt to start or join a Ray cluster fails the test. Also the
rollout engine tests' shared fixtures (tok, model, loop)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


# Shared by the rollout engine tests (a module that needs another tokenizer, e.g. one with tools,
# defines its own fixture of the same name, which wins): the tiny tokenizer, the tiny Qwen3 on it,
# and a thread running an event loop for the engines.


@pytest.fixture(scope="module")
def tok() -> Any:
    from services.common.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    from services.common.tiny import build_tiny_model

    return build_tiny_model("qwen3", tok, seed=0)


@pytest.fixture(scope="module")
def loop() -> Iterator[Any]:
    from tests.rollout_helpers import LoopThread

    lt = LoopThread()
    yield lt
    lt.close()
