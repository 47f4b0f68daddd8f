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
from typing import TYPE_CHECKING, Any

import torch

from services.common.errors import ConfigError
from services.weights import Bucket

if TYPE_CHECKING:
    from services.common.config.actor_rollout_ref import ActorConfig, ModelConfig, RefConfig


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
    """Non-padding tokens (prompt and response) of the whole mini-batch, over all ranks."""
    step: int


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine is built from (one rank; the process group comes from the
    torchrun-style environment RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, or a
    single-rank group when WORLD_SIZE is unset)."""

    model: ModelConfig
    """`actor_rollout_ref.model`."""
    actor: ActorConfig
    """`actor_rollout_ref.actor` (optimizer, micro-batching, parallelism, FSDP options)."""
    device: str
    """cuda, npu or cpu (services.common.device)."""
    total_training_steps: int
    """Optimizer steps the LR schedule spans; must be known before the optimizer is built.
    <= 0 is allowed only for a constant schedule without a warmup ratio."""
    ref: RefConfig | None = None
    """The frozen reference policy (initial weights) for the KL loss; None: no reference. It is
    sharded like the actor and shares its Ulysses degree."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Sequences per no-grad forward in compute_logprobs; None: the training micro-batch."""
    seed: int = 42
    """Seed for model init and training RNG."""
    collective_timeout_s: float = 600.0
    """Seconds before a collective is declared hung."""
    model_init: Callable[[], Any] | None = None
    """Builds the initial HF model on rank 0 when `model.path` is null (tests, built-in tiny model)."""


class TrainEngine(ABC):
    """One rank of a training group. Collective calls (train_step, compute_logprobs,
    export_weights, save/load_checkpoint, save_hf, snapshot_proximal) must be made on every rank of
    the group in the same order.

    Build with `get_engine_cls(backend, device).build(spec)`. An engine with several
    data-parallel ranks expects each rank to be given its own share of the data; ranks of one
    sequence-parallel group are given the same sequences."""

    backend: str = ""

    @classmethod
    def build(cls, spec: EngineSpec) -> TrainEngine:
        """Construct this rank's engine. Engines whose constructor differs override this."""
        return cls(spec)  # type: ignore[call-arg]

    @property
    def dp_rank(self) -> int:
        """This rank's index among data-parallel ranks (which share of the data it gets)."""
        return 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (world size / sequence-parallel size)."""
        return 1

    def snapshot_proximal(self) -> None:
        """Keep a copy of the current parameters as the proximal policy of decoupled PPO (the
        parameters at the start of a sync window); `compute_logprobs(proximal=True)` uses it."""
        raise ConfigError(
            f"the {self.backend or type(self).__name__} engine has no decoupled mode; set "
            "algorithm.rollout_correction.bypass_mode=true"
        )

    def compute_proximal_logprobs(self, batch: SequenceBatch, *, temperature: float = 1.0) -> ForwardOutput:
        """No-grad forward with the parameters of the last `snapshot_proximal`."""
        raise ConfigError(
            f"the {self.backend or type(self).__name__} engine has no decoupled mode; set "
            "algorithm.rollout_correction.bypass_mode=true"
        )

    def close(self) -> None:  # noqa: B027 -- optional hook, nothing to release by default
        """Release the engine's resources (process group, device memory)."""

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
    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        """Full (unsharded) weights by Hugging Face name, in buckets of at most bucket_bytes
        (a larger tensor travels alone). Every rank must iterate; only rank 0 yields data."""

    def export_shards(self, bucket_bytes: int) -> Iterator[Bucket]:
        """This rank's own part of the weights (every rank yields; wire names and reassembly:
        services/weights/shards.py), for `param_server.collective_sharded`. Engines that cannot
        say what they own keep this default."""
        raise ConfigError(
            f"the {type(self).__name__} engine cannot send its own shards; set param_server.collective_sharded=false"
        )

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
