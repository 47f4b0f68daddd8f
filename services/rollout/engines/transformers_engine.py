"""The transformers engine: continuous batching with slot refill over a Hugging Face causal LM.

Why our own scheduler: transformers' `generate` holds a batch until its longest sequence ends, and
its continuous-batching API (`generate_batch` / `ContinuousBatchingManager`) is slower than
`generate` on CPU at tiny sizes (BENCHMARKS.md, `meshrl bench rollout`). The scheduler
(transformers_scheduler.py) keeps one batched KV cache and, in its own thread, admits queued
sequences into free slots, decodes one token for every row, and retires finished rows at once, so
a short answer frees its slot for the next request instead of idling until the longest one in its
batch ends. Weights load in place by Hugging Face name (`param.copy_`), no rebuild; with
pause("keep") the KV computed with the old weights is kept and generation continues. LoRA
adapter versions are applied in place too (adapters.py).

This module is the asyncio facade: it validates, hands typed commands to the scheduler thread
and awaits their answers.

Sampling and logprobs follow services/rollout/engines/sampling.py (the trainer's definition).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from services.common.errors import DataLoss, FailedPrecondition, InvalidArgument, Unavailable
from services.weights import Bucket
from services.weights.adapter import split_descriptor

from .base import EngineHealth, GenerationRequest, PauseMode, RolloutEngine, SampleOutput, register_engine
from .transformers_scheduler import (
    Abort,
    AbortAll,
    Add,
    Close,
    Command,
    LoadAdapter,
    LoadBucket,
    Pause,
    Request,
    Resume,
    Scheduler,
    Seq,
    SetVersion,
)


@register_engine("transformers")
class TransformersEngine(RolloutEngine):
    """Continuous-batching engine over a transformers causal LM (CPU, CUDA, NPU).

    max_num_seqs: slots (rows of the running batch); max_num_batched_tokens: prompt tokens one
    prefill may take, its left padding counted (at least one prompt is always admitted)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: str = "cpu",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        version: int = 0,
        seed: int | None = None,
        weight_name: Callable[[str], str] | None = None,
    ) -> None:
        """`weight_name` maps a published weight name to this model's parameter name (a released
        multimodal checkpoint run as its language model: services/common/released.py)."""
        self._requests: dict[str, Request] = {}
        self._sched = Scheduler(
            model, tokenizer, self._requests, device=device, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, version=version, seed=seed,
            weight_name=weight_name,
        )
        self.model = self._sched.model
        self.tokenizer = tokenizer
        self.device = self._sched.device
        self.max_model_len = self._sched.max_model_len
        emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        rows = getattr(emb, "num_embeddings", None) or getattr(self.model.config, "vocab_size", None)
        self.vocab_size: int | None = int(rows) if rows else None
        """Rows of the input embedding: a prompt id outside them is refused (see generate)."""
        self._thread: threading.Thread | None = None

    @property
    def static_batching(self) -> bool:
        """True when the model's cache cannot be sliced by row (no slot refill; see Scheduler)."""
        return self._sched.static

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._sched.run, name="transformers-engine", daemon=True)
            self._thread.start()

    def _check_alive(self) -> None:
        if self._sched.error is not None:
            raise Unavailable(f"transformers engine failed: {self._sched.error!r}")
        if self._sched.closed:
            raise Unavailable("transformers engine is closed")
        if self._thread is None:
            raise FailedPrecondition("engine not started; call start() first")

    async def generate(self, request: GenerationRequest) -> list[SampleOutput]:
        self._check_alive()
        sp = request.sampling.validate()
        if request.request_id in self._requests:
            raise InvalidArgument("request_id", f"{request.request_id!r} is already in flight")
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise InvalidArgument("prompt_token_ids", "empty prompt")
        if self.vocab_size is not None and not 0 <= min(prompt) <= max(prompt) < self.vocab_size:
            # Its embedding lookup would raise in the scheduler thread (a device-side assert on
            # CUDA) and take every request in flight with it.
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise InvalidArgument(
                "prompt_token_ids", f"token id {bad} is outside the model's vocabulary of {self.vocab_size}; the "
                "tokenizer has ids the model has no embedding for (actor_rollout_ref.model.tokenizer_path must match the model)"
            )
        if len(prompt) >= self.max_model_len:
            raise InvalidArgument(
                "prompt_token_ids", f"{len(prompt)} tokens leave no room under max_model_len={self.max_model_len}"
            )
        loop = asyncio.get_running_loop()
        req = Request(request, loop.create_future(), loop)
        for i in range(sp.n):
            gen = None
            seed = sp.sample_seed(i)
            if seed is not None:
                gen = torch.Generator(device="cpu")
                gen.manual_seed(seed)
            req.seqs.append(Seq(req, SampleOutput(index=i), prompt, gen))
        self._requests[request.request_id] = req
        try:
            await self._command(Add(req))
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            # Also when cancelled while the add was queued: the abort follows it in the queue.
            # It names the request itself: cancelled again here, the finally below drops the id
            # before the thread applies the abort.
            await self._command(Abort(request.request_id, req))
            raise
        finally:
            self._requests.pop(request.request_id, None)

    async def abort(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        if req is None:
            return False
        await self._command(Abort(request_id, req))
        return True

    def request_started(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        return req is None or any(not s.queued for s in req.seqs)

    async def abort_all(self) -> dict[str, list[SampleOutput]]:
        reqs = dict(self._requests)
        await self._command(AbortAll())
        return {rid: await asyncio.shield(r.future) for rid, r in reqs.items()}

    async def pause(self, mode: PauseMode = "keep") -> None:
        if mode not in ("keep", "abort", "wait"):
            raise InvalidArgument("mode", f"unknown pause mode {mode!r}; use keep, abort or wait")
        await self._command(Pause(mode))

    async def resume(self) -> None:
        await self._command(Resume())

    @property
    def paused(self) -> bool:
        return self._sched.paused

    @property
    def version(self) -> int:
        return self._sched.version

    async def load_weights(self, version: int, buckets: AsyncIterator[Bucket]) -> int:
        self._check_alive()
        if not self._sched.paused:
            raise FailedPrecondition("load_weights needs a paused engine; call pause() first")
        loaded, spec, first = 0, None, True
        try:
            async for bucket in buckets:
                if first:  # an adapter-only version opens with its descriptor (services/weights/adapter.py)
                    spec, bucket = split_descriptor(bucket)
                command = LoadAdapter(spec, bucket, first) if spec is not None else LoadBucket(bucket)
                loaded += await self._command(command)
                first = False
            if spec is not None:
                await self._command(LoadAdapter(spec, [], first=False, last=True))
        except (InvalidArgument, FailedPrecondition) as exc:
            if loaded:
                # A refusal must change nothing (the worker resumes on the old weights after one);
                # these weights are part old, part new: the worker keeps generation paused.
                raise DataLoss(f"version {version} refused after {loaded} of its tensors were loaded ({exc}); "
                               "the model holds part of it") from exc
            raise
        await self._command(SetVersion(int(version)))
        return loaded

    async def health(self) -> EngineHealth:
        if self._sched.error is not None:
            return EngineHealth(False, f"scheduler thread failed: {self._sched.error!r}")
        if self._thread is None or not self._thread.is_alive():
            return EngineHealth(False, "scheduler thread not running")
        return EngineHealth(True)

    def stats(self) -> dict[str, float]:
        from services.common.device import detect, memory_stats

        out = self._sched.batch_stats()
        try:
            info = detect(self.device.type if self.device.type != "cpu" else "cpu")
            out.update(memory_stats(info, self.device.index or 0))
        except Exception:  # noqa: BLE001 - stats are best effort, never fail a status call
            pass
        return out

    async def close(self) -> None:
        """Stop the scheduler thread. Idempotent, and quiet once the thread has failed: it has
        already failed every request in flight and stopped, so there is nothing left to stop."""
        thread = self._thread
        if thread is not None and not self._sched.closed and self._sched.error is None:
            # A failure between the check and the command stops the thread all the same.
            with contextlib.suppress(Unavailable):
                await self._command(Close())
        self._sched.closed = True
        if thread is not None:
            await asyncio.to_thread(thread.join, 30.0)

    async def _command(self, command: Command) -> Any:
        self._check_alive()
        return await asyncio.wrap_future(self._sched.submit(command))
