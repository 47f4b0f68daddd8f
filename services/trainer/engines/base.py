"""The training-engine contract and its registry, keyed by (backend, device).

An engine owns one rank's share of the policy (and optionally the reference policy): it computes
per-token logprobs (and entropy), runs an optimizer step over micro-batches with gradient
accumulation, exports full weights by Hugging Face name in buckets, and saves/loads checkpoints.
Losses live in services/trainer/algos and reach the engine as a `LossFn`; engines know no RL.

Batches are token-aligned: for a sequence of prompt+response tokens x_0..x_{L-1}, position t of
every per-token tensor concerns token x_t (its logprob is log p(x_t | x_<t)); `response_mask[t]`
is 1 exactly for response tokens. Position 0 never carries a response token.

Registry:

    @register_engine("fsdp", "cpu", "cuda", "npu")
    class FSDPEngine(TrainEngine): ...

    engine_cls = get_engine_cls("fsdp2", "cuda")     # "fsdp" and "fsdp2" are one backend

Backends are imported lazily by name (`_BACKEND_MODULES`), so a missing optional dependency
(megatron-core, torch_npu) fails only when that backend is asked for, with an install hint.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.errors import ConfigError


@dataclass
class SequenceBatch:
    """B sequences (prompt + response), right-padded to length L, with per-token tensors."""

    input_ids: torch.Tensor
    """[B, L] int64 token ids (pad where attention_mask is 0)."""
    attention_mask: torch.Tensor
    """[B, L] int64, 1 for real tokens."""
    response_mask: torch.Tensor
    """[B, L] float32, 1 for response tokens (the ones the loss sees)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token [B, L] float tensors aligned like input_ids: "rollout_logprobs", "old_logprobs",
    "advantages", "ref_logprobs", ... (zeros outside response_mask)."""
    seq_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-sequence [B] tensors: "group_index", "reward", ..."""

    @property
    def num_seqs(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def select(self, index: torch.Tensor | list[int]) -> SequenceBatch:
        idx = torch.as_tensor(index, dtype=torch.long)
        return SequenceBatch(
            input_ids=self.input_ids[idx],
            attention_mask=self.attention_mask[idx],
            response_mask=self.response_mask[idx],
            tensors={k: v[idx] for k, v in self.tensors.items()},
            seq_tensors={k: v[idx] for k, v in self.seq_tensors.items()},
        )

    def to(self, device: torch.device | str) -> SequenceBatch:
        return SequenceBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            response_mask=self.response_mask.to(device),
            tensors={k: v.to(device) for k, v in self.tensors.items()},
            seq_tensors={k: v.to(device) for k, v in self.seq_tensors.items()},
        )


@dataclass
class ForwardOutput:
    """What a loss function sees for one micro-batch."""

    logprobs: torch.Tensor
    """[B, L] log p(x_t | x_<t) under the current parameters (0 where response_mask is 0)."""
    entropy: torch.Tensor | None
    """[B, L] entropy of the next-token distribution at t-1 (None if not asked for)."""


@dataclass(frozen=True)
class LossScale:
    """Global normalizers for one optimizer step, so that per-micro-batch losses summed (and
    gradients averaged over data-parallel ranks) equal the mini-batch loss exactly."""

    num_tokens: int
    """Response tokens in the whole mini-batch, across micro-batches and ranks."""
    num_seqs: int
    """Sequences in the whole mini-batch, across micro-batches and ranks."""
    dp_size: int
    """Data-parallel ranks that average gradients."""


LossFn = Callable[[ForwardOutput, SequenceBatch, LossScale], tuple[torch.Tensor, dict[str, float]]]
"""(outputs, micro-batch, scale) -> (scalar loss to backprop, metrics). Provided by algos."""


@dataclass
class StepResult:
    """One optimizer step."""

    grad_norm: float
    lr: float
    metrics: dict[str, float]
    num_tokens: int
    step: int


class TrainEngine(ABC):
    """One rank of a training group. Collective calls (train_step, export_weights,
    save/load_checkpoint) must be made on every rank of the group in the same order."""

    backend: str = ""

    @abstractmethod
    def compute_logprobs(
        self, batch: SequenceBatch, *, temperature: float = 1.0, with_entropy: bool = False, reference: bool = False
    ) -> ForwardOutput:
        """No-grad forward. `reference=True` uses the frozen reference policy."""

    @abstractmethod
    def train_step(
        self, micro_batches: list[SequenceBatch], loss_fn: LossFn, *, temperature: float = 1.0
    ) -> StepResult:
        """Forward/backward every micro-batch (gradient accumulation), clip, optimizer step, LR
        schedule step. Returns the step's metrics (averaged over micro-batches and ranks)."""

    @abstractmethod
    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) weights by Hugging Face name, in buckets of at most bucket_bytes
        (a larger tensor travels alone). Every rank must iterate; only rank 0 yields data."""

    @abstractmethod
    def save_checkpoint(self, path: Path) -> None:
        """Model, optimizer, scheduler, RNG and step, enough to continue bit-for-bit."""

    @abstractmethod
    def load_checkpoint(self, path: Path) -> None: ...

    @abstractmethod
    def save_hf(self, path: Path) -> None:
        """A checkpoint that transformers.AutoModelForCausalLM.from_pretrained loads."""

    @abstractmethod
    def memory_stats(self) -> dict[str, float]: ...

    @property
    @abstractmethod
    def step(self) -> int:
        """Optimizer steps taken."""


_REGISTRY: dict[tuple[str, str], type[TrainEngine]] = {}
_ALIASES = {"fsdp2": "fsdp"}
_BACKEND_MODULES = {
    "fsdp": "services.trainer.engines.fsdp",
    "megatron": "services.trainer.engines.megatron",
    "mindspeed": "services.trainer.engines.mindspeed",
}


def register_engine(backend: str, *devices: str) -> Callable[[type[TrainEngine]], type[TrainEngine]]:
    def register(cls: type[TrainEngine]) -> type[TrainEngine]:
        for device in devices:
            _REGISTRY[(backend, device)] = cls
        cls.backend = backend
        return cls

    return register


def get_engine_cls(backend: str, device: str) -> type[TrainEngine]:
    """The engine class for (backend, device); imports the backend module on first use."""
    name = _ALIASES.get(backend, backend)
    if (name, device) not in _REGISTRY and name in _BACKEND_MODULES:
        importlib.import_module(_BACKEND_MODULES[name])
    try:
        return _REGISTRY[(name, device)]
    except KeyError:
        known = sorted(f"{b}/{d}" for b, d in _REGISTRY)
        raise ConfigError(
            f"no training engine for actor.strategy={backend!r} on device {device!r} (registered: {known}); "
            "pick another actor_rollout_ref.actor.strategy or trainer.device"
        ) from None


def registered() -> dict[tuple[str, str], type[TrainEngine]]:
    return dict(_REGISTRY)
