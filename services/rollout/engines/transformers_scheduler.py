"""The transformers engine's scheduler: one thread owns the model, the batched KV cache and every
sequence, and runs

    loop:
      commands : apply what the asyncio side sent (typed commands, in order)
      admit    : queued sequences fill free slots: prefill them as one left-padded batch (a prompt
                 shared by the n samples of a request is prefilled once) and splice their KV into
                 the running cache, right-aligned, so every row writes the same next column
      decode   : one forward of [B, 1] tokens with per-row position ids and a 2-D attention mask
                 that hides each row's padding
      retire   : finished rows leave the batch at once (index_select), columns no row needs are cut

Nothing here is async: results go back through concurrent futures (commands) and the caller's
event loop (finished requests). The facade is transformers_engine.TransformersEngine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.errors import InvalidArgument, Unavailable
from services.common.logging import get_logger
from services.weights import Bucket
from services.weights.adapter import AdapterSpec

from .adapters import InPlaceLoRA
from .base import Finish, GenerationRequest, PauseMode, SampleOutput, stop_window
from .sampling import sample

log = get_logger(__name__)


@dataclass
class Request:
    request: GenerationRequest
    future: asyncio.Future[list[SampleOutput]]
    loop: asyncio.AbstractEventLoop
    seqs: list[Seq] = field(default_factory=list)
    done: bool = False

    def finish_if_complete(self, decode: Callable[[list[int]], str]) -> None:
        if self.done or any(s.active or s.queued for s in self.seqs):
            return
        self.done = True
        outs = [s.out for s in self.seqs]
        for o in outs:
            o.text = decode(o.token_ids)

        def deliver() -> None:
            if not self.future.done():
                self.future.set_result(outs)

        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the caller's loop is gone (shutdown): nobody is waiting
            pass


@dataclass
class Seq:
    req: Request
    out: SampleOutput
    prompt: list[int]
    generator: torch.Generator | None
    queued: bool = True
    active: bool = False
    pending_token: int | None = None
    """Sampled but not yet in the KV cache (the next decode step's input)."""
    cached: int = 0
    """Real (non-padding) tokens in this row's KV cache."""
    interrupted: bool = False

    @property
    def sampling(self) -> Any:
        return self.req.request.sampling


# ---- commands: what the asyncio side may ask, applied in order between two steps --------------


@dataclass(frozen=True)
class Add:
    """Queue a request's sequences."""

    req: Request


@dataclass(frozen=True)
class Abort:
    """End a request now (its future gets the partial outputs)."""

    request_id: str
    req: Request | None = None
    """The request as the caller saw it: a generate() that leaves (cancelled again while its abort
    is queued) takes its id out of the map before this applies, and the id may be reused."""


@dataclass(frozen=True)
class AbortAll:
    """End every request now."""


@dataclass(frozen=True)
class Pause:
    """Stop between two steps (`keep`), end every sequence (`abort`), or admit nothing new and
    answer once the running sequences finished (`wait`)."""

    mode: PauseMode


@dataclass(frozen=True)
class Resume:
    """Continue after a pause."""


@dataclass(frozen=True)
class LoadBucket:
    """Copy a bucket's tensors into the model, by Hugging Face name (paused only)."""

    bucket: Bucket


@dataclass(frozen=True)
class LoadAdapter:
    """Copy a bucket of a LoRA adapter version into the model (paused only; adapters.py)."""

    spec: AdapterSpec
    bucket: Bucket
    first: bool
    last: bool = False


@dataclass(frozen=True)
class SetVersion:
    """Tokens sampled from now on carry this policy version."""

    version: int


@dataclass(frozen=True)
class Close:
    """Stop the thread (every request is aborted)."""


Command = Add | Abort | AbortAll | Pause | Resume | LoadBucket | LoadAdapter | SetVersion | Close
_DEFERRED = object()  # the command's future is answered later (Pause("wait"))


class Scheduler:
    """Owns the model and the running batch; `run` is the body of its thread. `requests` is the
    asyncio side's map of requests in flight (read here to abort by id and to fail them all)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        requests: dict[str, Request],
        *,
        device: str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int | None,
        version: int,
        seed: int | None,
        weight_name: Callable[[str], str] | None = None,
    ) -> None:
        from transformers import DynamicCache

        kinds = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
        # Slot refill merges and slices KV caches row by row, which only full-attention layers
        # allow. Models with other layers (Qwen3.5's gated delta-net state) run in static batches:
        # a batch is admitted only when the previous one has finished, and finished rows ride
        # along unused until then. Correct but without refill; vLLM is the fast path for them.
        self.static = bool(kinds - {"DynamicLayer"})
        if self.static:
            log.warning("transformers_engine_static_batching", model=type(model).__name__, layers=sorted(kinds),
                        hint="no slot refill for non-full-attention caches; actor_rollout_ref.rollout.name=vllm is faster")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len or int(getattr(model.config, "max_position_embeddings", 4096))
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.version = version
        self._rng = torch.Generator(device=self.device)
        self._rng.manual_seed(seed if seed is not None else int(time.time_ns() % (1 << 62)))
        self._params = self._name_map()
        self._weight_name = weight_name
        self.lora = InPlaceLoRA(self.model)
        self._requests = requests
        # the running batch: touched only by this thread
        self._waiting: deque[Seq] = deque()
        self._rows: list[Seq] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        # read by the asyncio side
        self.paused = False
        self.closed = False
        self.error: BaseException | None = None
        self.counters = {"tokens_generated": 0, "steps": 0, "prefills": 0, "requests_finished": 0}
        self._pause_mode: PauseMode | None = None
        self._wait_futures: list[concurrent.futures.Future[Any]] = []
        self._commands: queue.SimpleQueue[tuple[Command, concurrent.futures.Future[Any]]] = queue.SimpleQueue()
        self._wake = threading.Event()

    def submit(self, command: Command) -> concurrent.futures.Future[Any]:
        """Queue a command (any thread); its future answers once the thread applied it."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((command, fut))
        self._wake.set()
        return fut

    def batch_stats(self) -> dict[str, float]:
        out: dict[str, float] = {k: float(v) for k, v in self.counters.items()}
        out["running_seqs"] = float(len(self._rows))
        out["waiting_seqs"] = float(len(self._waiting))
        out["kv_columns"] = float(self._mask.shape[1]) if self._mask is not None else 0.0
        # Share of the batched cache (rows x columns) that holds real tokens, the rest is padding:
        # this engine's "KV use" (it allocates per batch, not from a fixed pool as vLLM does).
        rows = list(self._rows)  # the scheduler thread may change the list meanwhile
        cells = len(rows) * out["kv_columns"]
        out["kv_cache_usage"] = sum(r.cached for r in rows) / cells if cells else 0.0
        return out

    # ---- the thread ------------------------------------------------------------------------------

    def run(self) -> None:
        """The thread's body: commands, then admit / decode / retire, until Close or a failure
        (which fails every request in flight and every queued command)."""
        try:
            with torch.inference_mode():
                while not self.closed:
                    self._apply_commands()
                    if self.closed:
                        break
                    idle_paused = self.paused and (self._pause_mode != "wait" or not self._rows)
                    if idle_paused or not (self._rows or self._waiting):
                        self._check_wait_done()
                        self._wake.wait(0.5)
                        self._wake.clear()
                        continue
                    if not self.paused:
                        self._admit()
                    if self._rows:
                        self._decode()
                    self._check_wait_done()
        except BaseException as exc:
            self.error = exc
            log.error("transformers_engine_failed", exc_info=exc)
            self._fail_all(exc)
        finally:
            self._abort_everything()
            self._drain_commands()

    def _apply_commands(self) -> None:
        while True:
            try:
                command, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                # The awaiting task was cancelled (an aborted group, a drain). The command still
                # applies, answering no one: a cancelled generate() queues its abort behind its add.
                fut = concurrent.futures.Future()
                fut.set_running_or_notify_cancel()
            try:
                result = self._apply(command, fut)
            except Exception as exc:  # noqa: BLE001 - handed back to the awaiting caller
                fut.set_exception(exc)
                continue
            if result is not _DEFERRED:
                fut.set_result(result)

    def _apply(self, command: Command, fut: concurrent.futures.Future[Any]) -> Any:
        match command:
            case Add(req=req):
                self._waiting.extend(req.seqs)
            case Abort(request_id=request_id, req=req):
                found = req if req is not None else self._requests.get(request_id)
                if found is not None:
                    self._abort_request(found)
            case AbortAll():
                self._abort_everything()
            case Pause(mode=mode):
                self.paused = True
                self._pause_mode = mode
                # Only active rows: in static batches finished rows stay in `_rows` (see _retire),
                # and their outputs are already with the caller.
                for s in self._rows:
                    if s.active:
                        s.interrupted = True
                if mode == "abort":
                    self._abort_everything()
                if mode == "wait" and self._rows:
                    self._wait_futures.append(fut)
                    return _DEFERRED
            case Resume():
                for s in self._rows:
                    # A row that finished while paused (aborted, or drained by `wait`) was delivered
                    # without a resume to count.
                    if s.interrupted and s.active:
                        s.out.num_resumes += 1
                    s.interrupted = False
                self.paused = False
                self._pause_mode = None
            case LoadBucket(bucket=bucket):
                return self._load_bucket(bucket)
            case LoadAdapter(spec=spec, bucket=bucket, first=first, last=last):
                return self.lora.load(spec, bucket, first=first, last=last)
            case SetVersion(version=version):
                self.version = version
            case Close():
                self.closed = True
        return None

    def _check_wait_done(self) -> None:
        if self._wait_futures and not self._rows:
            for f in self._wait_futures:
                f.set_result(None)
            self._wait_futures.clear()

    def _drain_commands(self) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(Unavailable("transformers engine stopped"))
        for f in self._wait_futures:
            f.set_result(None)
        self._wait_futures.clear()

    # ---- weights ---------------------------------------------------------------------------------

    def _name_map(self) -> dict[str, torch.Tensor]:
        # state_dict keeps tied aliases (lm_head.weight and embed_tokens.weight) under both names.
        named: dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        return {k: (v.data if isinstance(v, torch.nn.Parameter) else v) for k, v in named.items()}

    def _load_bucket(self, bucket: Bucket) -> int:
        """Every tensor of the bucket checked before any is copied: a refused bucket changes nothing."""
        targets = []
        for name, tensor in bucket:
            target = self._params.get(name)
            if target is None and self._weight_name is not None:
                target = self._params.get(self._weight_name(name))
            if target is None:
                raise InvalidArgument("weights", f"unknown parameter {name!r} for {type(self.model).__name__}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise InvalidArgument(
                    "weights", f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
                )
            targets.append(target)
        self.lora.base_replaced()  # only once the bucket is accepted: a refusal changes nothing
        for target, (_, tensor) in zip(targets, bucket, strict=True):
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        return len(bucket)

    # ---- batching --------------------------------------------------------------------------------

    def _abort_request(self, req: Request) -> None:
        for s in req.seqs:
            if s.queued:
                s.queued = False
                s.out.finish_reason = Finish.ABORT
                self._waiting.remove(s)
        self._retire([i for i, s in enumerate(self._rows) if s.req is req and s.active], Finish.ABORT)
        req.finish_if_complete(self._decode_text)

    def _abort_everything(self) -> None:
        reqs = {id(s.req): s.req for s in itertools.chain(self._rows, self._waiting)}
        for req in reqs.values():
            self._abort_request(req)

    def _fail_all(self, exc: BaseException) -> None:
        for req in list(self._requests.values()):
            err = Unavailable(f"transformers engine failed: {exc!r}")

            def deliver(r: Request = req, e: Exception = err) -> None:
                if not r.future.done():
                    r.future.set_exception(e)

            try:
                req.loop.call_soon_threadsafe(deliver)
            except RuntimeError:
                pass

    def _decode_text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _admit(self) -> None:
        free = self.max_num_seqs - len(self._rows)
        if free <= 0 or not self._waiting or (self.static and self._rows):
            return
        batch: list[Seq] = []
        uniques: dict[tuple[int, int], int] = {}
        width = 0
        while self._waiting and len(batch) < free:
            s = self._waiting[0]
            key = self._prefill_key(s)
            # The prefill runs its unique prompts left-padded to the longest: it costs rows x
            # width, not the sum of the prompt lengths (a long prompt beside short ones multiplies).
            # A sample whose prompt is already in costs nothing more.
            cost = (len(uniques) + 1) * max(width, len(s.prompt))
            if batch and key not in uniques and cost > self.max_num_batched_tokens:
                break
            self._waiting.popleft()
            s.queued = False
            if key not in uniques:
                uniques[key] = len(uniques)
                width = max(width, len(s.prompt))
            batch.append(s)
        prompts: list[list[int]] = [[] for _ in uniques]
        for s in batch:
            prompts[uniques[self._prefill_key(s)]] = s.prompt
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        )
        self.counters["prefills"] += 1
        new_cache = out.past_key_values
        if self.static:  # one row per sequence already: nothing to select
            logits, new_mask = out.logits[:, -1, :], mask
        else:
            select = torch.tensor([uniques[self._prefill_key(s)] for s in batch], device=self.device)
            logits = out.logits[:, -1, :].index_select(0, select)
            for layer in new_cache.layers:
                layer.keys = layer.keys.index_select(0, select)
                layer.values = layer.values.index_select(0, select)
            new_mask = mask.index_select(0, select)
        for s in batch:
            s.active = True
            s.cached = len(s.prompt)
        self._merge(new_cache, new_mask, batch)
        self._sample_and_advance(logits, list(range(len(self._rows) - len(batch), len(self._rows))))

    def _prefill_key(self, s: Seq) -> tuple[int, int]:
        """Samples of one request share a prompt: prefilled once and copied (refill mode only)."""
        return (id(s), 0) if self.static else (id(s.req), len(s.prompt))

    def _merge(self, cache: Any, mask: torch.Tensor, seqs: list[Seq]) -> None:
        if self._cache is None or not self._rows:
            self._cache, self._mask, self._rows = cache, mask, list(seqs)
            return
        assert self._mask is not None
        w_old, w_new = self._mask.shape[1], mask.shape[1]
        width = max(w_old, w_new)

        def pad(t: torch.Tensor, w: int) -> torch.Tensor:
            if w == width:
                return t
            shape = list(t.shape)
            shape[2 if t.dim() == 4 else 1] = width - w
            return torch.cat([t.new_zeros(shape), t], dim=2 if t.dim() == 4 else 1)

        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([pad(old.keys, w_old), pad(new.keys, w_new)], dim=0)
            old.values = torch.cat([pad(old.values, w_old), pad(new.values, w_new)], dim=0)
        self._mask = torch.cat([pad(self._mask, w_old), pad(mask, w_new)], dim=0)
        self._rows.extend(seqs)

    def _decode(self) -> None:
        assert self._mask is not None
        rows = self._rows
        ids = torch.tensor([[s.pending_token] for s in rows], dtype=torch.long, device=self.device)
        positions = torch.tensor([[s.cached] for s in rows], dtype=torch.long, device=self.device)
        mask = torch.cat([self._mask, self._mask.new_ones((len(rows), 1))], dim=1)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self._cache, use_cache=True
        )
        self._mask = mask
        for s in rows:
            s.cached += 1
        self.counters["steps"] += 1
        if self.static:
            live = [i for i, s in enumerate(rows) if s.active]
            index = torch.tensor(live, device=self.device)
            self._sample_and_advance(out.logits[:, -1, :].index_select(0, index), live)
        else:
            self._sample_and_advance(out.logits[:, -1, :], list(range(len(rows))))

    def _sample_and_advance(self, logits: torch.Tensor, row_idx: list[int]) -> None:
        seqs = [self._rows[i] for i in row_idx]
        sps = [s.sampling for s in seqs]
        temperature = torch.tensor([sp.temperature for sp in sps], dtype=torch.float32, device=self.device)
        top_k = torch.tensor([sp.top_k for sp in sps], dtype=torch.long, device=self.device)
        top_p = torch.tensor([sp.top_p for sp in sps], dtype=torch.float32, device=self.device)
        tokens, logprobs = sample(logits, temperature, top_k, top_p, [s.generator for s in seqs], self._rng)
        tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
        finished: list[tuple[int, Finish]] = []
        for i, s, tok, lp in zip(row_idx, seqs, tokens_l, logprobs_l, strict=True):
            o = s.out
            o.token_ids.append(int(tok))
            o.logprobs.append(float(lp))
            o.versions.append(self.version)
            s.pending_token = int(tok)
            if s.req.request.on_token is not None:  # streaming: the token, to the caller's loop now
                with contextlib.suppress(RuntimeError):  # the caller's loop is gone (shutdown): nobody listens
                    s.req.loop.call_soon_threadsafe(s.req.request.on_token, o.index, int(tok), float(lp))
            reason = self._finish_reason(s)
            if reason is not None:
                finished.append((i, reason))
        self.counters["tokens_generated"] += len(seqs)
        if finished:
            self._retire([i for i, _ in finished], None, dict(finished))

    def _finish_reason(self, s: Seq) -> Finish | None:
        o, sp = s.out, s.sampling
        if o.token_ids[-1] in self.eos_ids:
            return Finish.STOP
        if sp.stop:
            window = stop_window(sp.stop)
            tail = str(self.tokenizer.decode(o.token_ids[-window:], skip_special_tokens=False))
            if any(x in tail for x in sp.stop):
                return Finish.STOP
        if len(o.token_ids) >= sp.max_tokens or len(s.prompt) + len(o.token_ids) >= self.max_model_len:
            return Finish.LENGTH
        return None

    def _drop_rows(self, keep: list[int]) -> None:
        """Keep only rows `keep` of the running batch (cache, mask, rows), trimming shared padding."""
        if keep:
            assert self._mask is not None
            idx = torch.tensor(keep, device=self.device)
            mask = self._mask.index_select(0, idx)
            used = mask.any(dim=0).nonzero()
            first = int(used[0]) if used.numel() else mask.shape[1]
            self._mask = mask[:, first:]
            for layer in self._cache.layers:
                layer.keys = layer.keys.index_select(0, idx)[:, :, first:]
                layer.values = layer.values.index_select(0, idx)[:, :, first:]
            self._rows = [self._rows[i] for i in keep]
        else:
            self._cache, self._mask, self._rows = None, None, []

    def _retire(self, row_idx: list[int], reason: Finish | None, reasons: dict[int, Finish] | None = None) -> None:
        if not row_idx:
            return
        gone = set(row_idx)
        for i in row_idx:
            s = self._rows[i]
            s.out.finish_reason = reason if reason is not None else (reasons or {})[i]
            s.active = False
        reqs = {id(self._rows[i].req): self._rows[i].req for i in row_idx}
        if self.static:
            # Rows stay in the batch (a recurrent cache state cannot be sliced out) until every
            # row of the batch is done; then the batch is dropped whole.
            if not any(s.active for s in self._rows):
                self._cache, self._mask, self._rows = None, None, []
        else:
            self._drop_rows([i for i in range(len(self._rows)) if i not in gone])
        self.counters["requests_finished"] += sum(
            1 for r in reqs.values() if not any(s.active or s.queued for s in r.seqs)
        )
        for r in reqs.values():
            r.finish_if_complete(self._decode_text)
