"""The rollout-engine contract and its registry.

An engine owns one model replica and generates. The worker (services/rollout/worker.py) drives it:

    outs = await engine.generate(GenerationRequest(request_id, prompt_ids, SamplingSpec(n=4, ...)))
    # on a new policy version:
    await engine.pause(mode="keep")          # or "abort" / "wait"
    await engine.load_weights(version, buckets)
    await engine.resume()

Timeline of a weight update, who waits for whom:

    worker     pause(mode) ─────────► load_weights(v, buckets) ─► resume()
    engine     keep:  in-flight sequences stop between two steps, KV kept; continue after resume
               abort: in-flight sequences end now (finish_reason=abort, partial tokens returned)
               wait:  no new sequence starts; pause() returns when the running ones have finished
    generate() calls made while paused queue and start after resume().

Logprobs (the contract with the trainer). For every sampled token x_t the engine reports

    logprob_t = log_softmax(logits_t / temperature)[x_t]

i.e. the temperature-scaled distribution *before* top-k / top-p truncation, which is what the
trainer recomputes (common.proto, Response.logprobs). With temperature == 0 (greedy) the engine
takes the argmax and reports log_softmax(logits_t)[x_t] (temperature 1).

Versions. Every token carries the policy version of the weights that computed its logits; an
engine records the version given to `load_weights` once all its buckets are in.

Outputs. `token_ids` include the end-of-sequence token when one was sampled and the tokens of a
matched stop string (the trainer sees exactly what was sampled); `text` is the decode of
`token_ids` with special tokens skipped, so a stop string is at its end.

Registry: `@register_engine("name")`; `get_engine_cls(name)` imports the backend module on first
use, so a missing optional dependency (vllm) fails only when that engine is asked for.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from services.common.errors import ConfigError, InvalidArgument
from services.weights import Bucket

PauseMode = Literal["keep", "abort", "wait"]


class Finish(StrEnum):
    STOP = "stop"
    """End-of-sequence token or a stop string."""
    LENGTH = "length"
    """max_tokens reached (or the engine's context limit)."""
    ABORT = "abort"
    """Aborted; the output holds the tokens generated so far."""


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters of one request (one prompt, n samples)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None
    """Sample i of the request uses seed + i; None: engine randomness."""

    def validate(self, where: str = "sampling") -> SamplingSpec:
        if self.n < 1:
            raise InvalidArgument(f"{where}.n", f"must be >= 1, got {self.n}")
        if not self.temperature >= 0:
            raise InvalidArgument(f"{where}.temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"{where}.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidArgument(f"{where}.top_k", f"must be -1 (off) or >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidArgument(f"{where}.max_tokens", f"must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise InvalidArgument(f"{where}.stop", "empty stop strings are not allowed")
        return self

    def sample_seed(self, index: int) -> int | None:
        return None if self.seed is None else self.seed + index


def stop_window(stop: Sequence[str]) -> int:
    """How many trailing tokens to decode to see every stop string whole: its length in UTF-8
    bytes. A token carries at least one byte, but a character may span several tokens (byte-level
    BPE splits one outside its merges into its bytes, and a lone byte of one decodes to U+FFFD), so
    a window counted in characters can miss a stop string that is there."""
    return max(len(x.encode("utf-8")) for x in stop)


def stop_across(decode: Callable[[list[int]], str], token_ids: list[int], boundary: int,
                stop: Sequence[str]) -> int | None:
    """A continuation (partial rollout, mode abort) starts at `boundary`; the engine that generated
    it saw only its own text, so a stop string that begins before the boundary and completes after
    it went unseen. Returns how many tokens to keep (through the token that completes the first
    such stop string), or None."""
    if not stop or boundary >= len(token_ids):
        return None
    window = stop_window(stop)
    for k in range(boundary + 1, min(len(token_ids), boundary + window) + 1):
        tail = decode(token_ids[max(0, k - window) : k])
        if any(x in tail for x in stop):
            return k
    return None


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    """Unique among this engine's in-flight requests."""
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    on_token: Callable[[int, int, float], None] | None = field(default=None, compare=False)
    """Optional, for streaming (the gateway's `stream: true`): called on the caller's event loop
    with (sample index, token id, logprob) for every token as it is sampled, in order, all of them
    before generate() returns. Both engines call it (vllm then asks for its outputs as deltas); an
    engine that cannot stream never calls it, and the caller sees the whole completion at the end."""


@dataclass
class SampleOutput:
    """One sample. token_ids, logprobs and versions have equal length."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: Finish = Finish.ABORT
    text: str = ""
    num_resumes: int = 0
    """Pauses of kind `keep` this sample was interrupted by (it continued afterwards)."""

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class EngineHealth:
    healthy: bool
    detail: str = ""


class RolloutEngine(ABC):
    """One inference replica. All methods are called from one asyncio loop."""

    name: str = ""

    @abstractmethod
    async def start(self) -> None:
        """Bring the engine up (load the model, start its loop). Idempotent."""

    @abstractmethod
    async def generate(self, request: GenerationRequest) -> list[SampleOutput]:
        """n samples for one prompt, in sample order. Cancelling the awaiting task aborts the
        request. A request aborted (abort(), pause("abort"), abort_all()) returns its partial
        samples with finish_reason ABORT instead of raising."""

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Abort one request (its generate() returns partial samples). False if unknown."""

    def request_started(self, request_id: str) -> bool:
        """Whether any sample of the request has left the waiting queue (drain returns the leases
        of unstarted requests). Unknown ids count as started."""
        return True

    @abstractmethod
    async def abort_all(self) -> dict[str, list[SampleOutput]]:
        """Abort every request, queued or running; returns their partial samples by request id."""

    @abstractmethod
    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop generating (see the module docstring for the three modes). Returns once no step
        runs any more; idempotent."""

    @abstractmethod
    async def resume(self) -> None:
        """Undo pause(); queued and kept requests continue."""

    @property
    @abstractmethod
    def paused(self) -> bool: ...

    @abstractmethod
    async def load_weights(self, version: int, buckets: AsyncIterator[Bucket]) -> int:
        """Load named tensors bucket by bucket into the running model (no rebuild) and record
        `version` for tokens generated from now on. The engine must be paused. Returns the number
        of tensors loaded. A failure leaves the version unchanged and raises; a refusal
        (InvalidArgument, FailedPrecondition) must leave the weights unchanged too (the worker then
        generates on them again), so one found after weights were written is raised as another
        error (the worker keeps generation paused until a whole version loads)."""

    @property
    @abstractmethod
    def version(self) -> int:
        """Policy version of the loaded weights."""

    @abstractmethod
    async def health(self) -> EngineHealth: ...

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """Numbers for GetRolloutStatus: memory, running/waiting sequences, tokens generated."""

    @abstractmethod
    async def close(self) -> None:
        """Stop the engine and free its resources; in-flight requests end aborted."""


_REGISTRY: dict[str, type[RolloutEngine]] = {}
_ENGINE_MODULES = {
    "transformers": "services.rollout.engines.transformers_engine",
    "vllm": "services.rollout.engines.vllm_engine",
}


def register_engine(name: str) -> Callable[[type[RolloutEngine]], type[RolloutEngine]]:
    def register(cls: type[RolloutEngine]) -> type[RolloutEngine]:
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return register


def get_engine_cls(name: str) -> type[RolloutEngine]:
    """The engine class registered as `name`; imports its module on first use."""
    if name not in _REGISTRY and name in _ENGINE_MODULES:
        importlib.import_module(_ENGINE_MODULES[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown rollout engine actor_rollout_ref.rollout.name={name!r}; use one of {sorted(_ENGINE_MODULES)}"
        ) from None


def engine_names() -> list[str]:
    return sorted(_ENGINE_MODULES)
