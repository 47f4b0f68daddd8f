"""Shutdown after a failure: the transformers engine closes quietly once its scheduler thread has
failed, and the rollout replica closes its coordinator channel whatever the engine's close does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.common.errors import Unavailable
from services.common.tiny import build_tiny_model, build_tokenizer
from services.rollout.deployment import RolloutDeployment
from services.rollout.engines import GenerationRequest, SamplingSpec
from services.rollout.engines.transformers_engine import TransformersEngine


def test_the_transformers_engine_closes_quietly_after_its_thread_failed() -> None:
    tok = build_tokenizer()
    engine = TransformersEngine(build_tiny_model("qwen3", tok, seed=0), tok)

    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA out of memory (simulated)")

    async def main() -> None:
        await engine.start()
        engine.model.forward = out_of_memory
        with pytest.raises(Unavailable, match="out of memory"):
            await engine.generate(GenerationRequest("r", list(tok.encode("hi")), SamplingSpec(max_tokens=4)))
        await engine.close()  # the thread is gone: nothing left to stop, nothing to raise
        await engine.close()  # and again
        assert not (await engine.health()).healthy
        with pytest.raises(Unavailable):
            await engine.generate(GenerationRequest("r2", list(tok.encode("hi")), SamplingSpec(max_tokens=4)))

    asyncio.run(main())


def test_the_transformers_engine_close_is_idempotent() -> None:
    tok = build_tokenizer()
    engine = TransformersEngine(build_tiny_model("qwen3", tok, seed=0), tok)

    async def main() -> None:
        await engine.close()  # never started
        await engine.start()
        await engine.close()
        await engine.close()
        assert (await engine.health()).detail == "scheduler thread not running"

    asyncio.run(main())


class _StoppedWorker:
    async def stop(self, finish_in_flight: bool = True) -> tuple[int, int]:
        return 0, 0


class _FailingEngine:
    async def close(self) -> None:
        raise Unavailable("transformers engine failed: RuntimeError('boom')")


class _Channel:
    closed = False

    async def close(self) -> None:
        self.closed = True


def test_the_replica_closes_its_coordinator_channel_when_the_engine_close_fails() -> None:
    # The replica class without its async __del__ on garbage collection (run by hand below).
    replica = object.__new__(type("Replica", (RolloutDeployment,), {"__del__": lambda self: None}))
    replica.worker = _StoppedWorker()
    replica.engine = _FailingEngine()
    replica.coordinator = channel = _Channel()
    with pytest.raises(Unavailable):
        asyncio.run(RolloutDeployment.__del__(replica))
    assert channel.closed
