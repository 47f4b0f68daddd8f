"""The root of the config tree and the quantities derived from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import model_validator

from .actor_rollout_ref import COLLECTIVE_BACKENDS, ActorRolloutRefConfig
from .agent import AgentConfig
from .algorithm import AlgorithmConfig, CustomRewardFunctionConfig, RewardModelConfig
from .async_training import AsyncTrainingConfig
from .base import ConfigModel
from .coordinator import CoordinatorConfig
from .data import DataConfig
from .environment import EnvironmentConfig
from .param_server import ParamServerConfig
from .resolve import resolve_tree
from .reward import RewardServiceConfig
from .rollout_worker import RolloutWorkerConfig
from .security import SecurityConfig
from .serve import ServeConfig
from .trainer import RolloutResourcesConfig, TrainerConfig
from .trainer_loop import run_length
from .trainer_service import TrainerServiceConfig
from .tuning import TuningConfig

_GROUP_ESTIMATORS = {"grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"}


class MeshConfig(ConfigModel):
    """A whole meshrl run. verl's sections keep verl's names; meshrl's own services add theirs.
    Input is resolved first (resolve.py: verl's aliases, what a mode implies, old spellings);
    the checks below only check."""

    data: DataConfig = DataConfig()
    """Prompt data."""
    actor_rollout_ref: ActorRolloutRefConfig = ActorRolloutRefConfig()
    """Model, actor, rollout engine, reference."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Advantages, corrections, dynamic sampling."""
    reward_model: RewardModelConfig = RewardModelConfig()
    """Reward assembly (DAPO overlong shaping)."""
    custom_reward_function: CustomRewardFunctionConfig = CustomRewardFunctionConfig()
    """A verl-style `compute_score` function."""
    trainer: TrainerConfig = TrainerConfig()
    """Run length, training resources, checkpoints."""
    rollout: RolloutResourcesConfig = RolloutResourcesConfig()
    """Rollout resources and run length (verl fully async)."""
    async_training: AsyncTrainingConfig = AsyncTrainingConfig()
    """Staleness budget and partial rollout."""
    coordinator: CoordinatorConfig = CoordinatorConfig()
    """The coordinator service."""
    param_server: ParamServerConfig = ParamServerConfig()
    """The param server service."""
    reward: RewardServiceConfig = RewardServiceConfig()
    """The reward service."""
    environment: EnvironmentConfig = EnvironmentConfig()
    """Environments of multi-turn trajectories (external EnvironmentService endpoints)."""
    trainer_service: TrainerServiceConfig = TrainerServiceConfig()
    """The trainer service (coordinator link, checkpoints kept, weight publisher; `loop`: its
    loop's settings, filled from verl's keys at load)."""
    rollout_worker: RolloutWorkerConfig = RolloutWorkerConfig()
    """The rollout replicas' worker loop (engine knobs are actor_rollout_ref.rollout.*)."""
    serve: ServeConfig = ServeConfig()
    """Ray Serve deployment."""
    tuning: TuningConfig = TuningConfig()
    """Process-level performance knobs (CPU niceness)."""
    agent: AgentConfig = AgentConfig()
    """Black-box agents trained through the OpenAI-compatible gateway (agent.command / agent.endpoint)."""

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data: Any) -> Any:
        return resolve_tree(data)
    security: SecurityConfig = SecurityConfig()
    """Tokens per role (read from the environment), TLS, and per-server/per-client bounds."""

    @model_validator(mode="after")
    def _cross_field(self) -> MeshConfig:
        arr = self.actor_rollout_ref
        if self.algorithm.adv_estimator in _GROUP_ESTIMATORS and arr.rollout.n < 2:
            raise ValueError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs a group baseline, so "
                f"actor_rollout_ref.rollout.n must be >= 2 (got {arr.rollout.n}); set actor_rollout_ref.rollout.n=4"
            )
        if self.async_training.mode == "fully_async" and self.data.train_batch_size not in (0,):
            raise ValueError(
                "fully async batches are ppo_mini_batch_size * require_batches prompts; set data.train_batch_size=0"
            )
        if self.agent.enabled and arr.rollout.multi_turn.enable:
            raise ValueError(
                "agent.command / agent.endpoint play each prompt through the gateway; the in-process agent loop "
                "(actor_rollout_ref.rollout.multi_turn.enable) is the other way: set one of them"
            )
        mml, max_prompt = arr.rollout.max_model_len, self.data.max_prompt_length
        if mml is not None and mml <= max_prompt:
            # The engine refuses a prompt that leaves no room under max_model_len as bad input,
            # which stops the replica; prompts up to max_prompt_length reach it. Below prompt +
            # response stays allowed: a sample then ends with `length` at the context limit.
            raise ValueError(
                f"actor_rollout_ref.rollout.max_model_len={mml} leaves no room to generate after a prompt of "
                f"data.max_prompt_length={max_prompt} tokens; raise it (null: {max_prompt} + "
                f"data.max_response_length={self.data.max_response_length}) or lower data.max_prompt_length"
            )
        bound, budget = self.coordinator.max_response_tokens, self.data.max_response_length
        if bound < budget:
            # The coordinator refuses a response over its bound (it cuts nothing): every response that
            # used the budget failed its SubmitGroups call, with the groups coalesced into it.
            raise ValueError(
                f"coordinator.max_response_tokens={bound} is below data.max_response_length={budget}: the coordinator "
                "would refuse every response longer than the bound (failing its group and the groups submitted "
                f"with it); raise coordinator.max_response_tokens to at least {budget} (or lower "
                "data.max_response_length)"
            )
        load_s, transfer_s = self.rollout_worker.weight_load_timeout_s, self.param_server.transfer_timeout_s
        if load_s < transfer_s:
            # A replica's update (fetch + load) is cut at weight_load_timeout_s and retried with the
            # same deadline: a version whose transfer needs longer never loads, and the replica stays
            # paused for the rest of the run.
            raise ValueError(
                f"rollout_worker.weight_load_timeout_s={load_s} is below param_server.transfer_timeout_s={transfer_s}: "
                "a rollout replica would give up on a weight transfer the param server still allows, and retry it "
                f"with the same deadline; raise rollout_worker.weight_load_timeout_s to at least {transfer_s} "
                "(it also covers loading into the engine)"
            )
        if self.data.train_files == [] and self.data.synthetic is None:
            raise ValueError("no prompt data: set data.train_files or data.synthetic")
        concurrent, per_call = self.async_training.concurrent_samples_per_replica, self.coordinator.max_groups_per_call
        if concurrent > per_call:
            raise ValueError(
                f"async_training.concurrent_samples_per_replica={concurrent} is more than coordinator.max_groups_per_call="
                f"{per_call}: a rollout replica leases and renews its groups in one call, which the coordinator "
                f"would refuse every time; set coordinator.max_groups_per_call={concurrent} (or lower the other)"
            )
        if self.algorithm.filter_groups.enable and arr.rollout.n < 2:
            raise ValueError("algorithm.filter_groups needs actor_rollout_ref.rollout.n >= 2")
        ttl, renew = self.coordinator.replica_ttl_s, self.rollout_worker.lease_renew_interval_s
        if ttl is not None and renew is not None and renew > ttl / 2:
            raise ValueError(
                f"rollout_worker.lease_renew_interval_s={renew} is the replicas' heartbeat and must be at most half "
                f"of coordinator.replica_ttl_s={ttl} (else a live replica is taken for dead); lower it, or leave it "
                "unset (replica_ttl_s / 4)"
            )
        if renew is not None and renew > self.coordinator.lease_timeout_s / 2:
            raise ValueError(
                f"rollout_worker.lease_renew_interval_s={renew} must be at most half of coordinator.lease_timeout_s="
                f"{self.coordinator.lease_timeout_s} (a lease not renewed within lease_timeout_s expires and its "
                "prompt is re-issued); lower it, or leave it unset"
            )
        tbs = self.data.train_batch_size
        per_version = (arr.actor.ppo_mini_batch_size * self.async_training.require_batches
                       * self.async_training.trigger_parameter_sync_step)
        if tbs not in (0, per_version):
            raise ValueError(
                f"data.train_batch_size={tbs} is not what a weight version trains: meshrl's batches are "
                f"actor_rollout_ref.actor.ppo_mini_batch_size * async_training.require_batches * "
                f"trigger_parameter_sync_step = {per_version} prompts; set data.train_batch_size=0 and choose "
                "require_batches / trigger_parameter_sync_step (verl's colocate-equivalent: train_batch_size / "
                "ppo_mini_batch_size), or set data.train_batch_size to that product"
            )
        if arr.model.lora_rank > 0 and arr.actor.strategy in ("megatron", "mindspeed"):
            raise ValueError(
                f"actor_rollout_ref.model.lora_rank={arr.model.lora_rank}: LoRA is not supported by the "
                f"{arr.actor.strategy} engine (it would train the full weights); use "
                "actor_rollout_ref.actor.strategy=fsdp2 for LoRA, or set actor_rollout_ref.model.lora_rank=0"
            )
        if self.param_server.delta_sync:
            if arr.rollout.checkpoint_engine.backend not in COLLECTIVE_BACKENDS:
                raise ValueError(
                    "param_server.delta_sync needs a collective transport (every receiver takes every version, so "
                    "all hold the base); set actor_rollout_ref.rollout.checkpoint_engine.backend=nccl (or hccl, gloo), "
                    "or param_server.delta_sync=false"
                )
            if arr.model.lora_rank > 0:
                raise ValueError(
                    "param_server.delta_sync sends changed elements of the full weights; a LoRA run's versions are the "
                    "adapter alone (small): set param_server.delta_sync=false with actor_rollout_ref.model.lora_rank>0"
                )
        if self.param_server.collective_sharded:
            if arr.rollout.checkpoint_engine.backend not in COLLECTIVE_BACKENDS:
                raise ValueError(
                    "param_server.collective_sharded needs a collective transport; set "
                    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl (or hccl, gloo)"
                )
            if arr.model.lora_rank > 0:
                raise ValueError(
                    "param_server.collective_sharded sends each rank's part of the full weights; a LoRA run's versions are the "
                    "adapter alone (small): set param_server.collective_sharded=false with actor_rollout_ref.model.lora_rank>0"
                )
        scaling = self.serve.rollout.autoscaling
        backend = arr.rollout.checkpoint_engine.backend
        if backend in COLLECTIVE_BACKENDS and scaling is not None and scaling.min_replicas != scaling.max_replicas:
            # The broadcast group's size is fixed when it forms (services/param_server/rendezvous.py):
            # below it every broadcast waits for ranks that never check in, and a replica added above
            # it finds the group full and never gets weights.
            raise ValueError(
                f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend} broadcasts to a fixed number of "
                f"rollout replicas, but serve.rollout.autoscaling.min_replicas={scaling.min_replicas} != "
                f"serve.rollout.autoscaling.max_replicas={scaling.max_replicas} lets the count change; set "
                "min_replicas == max_replicas (or use serve.rollout.num_replicas), or use the grpc or object_store "
                "transport with autoscaling"
            )
        if self.reward_model.overlong_buffer.enable:
            ob = self.reward_model.overlong_buffer
            if ob.len <= 0 or ob.len > self.data.max_response_length:
                raise ValueError(
                    f"reward_model.overlong_buffer.len must be in (0, data.max_response_length={self.data.max_response_length}], got {ob.len}"
                )
        return self


@dataclass(frozen=True)
class Derived:
    """Quantities computed from a config (see AsyncTrainingConfig's docstring)."""

    required_samples: int
    max_required_samples: int
    total_rollout_steps: int
    total_train_steps: int
    """Weight versions the run publishes (verl's total_train_steps)."""
    total_local_steps: int
    """Trainer steps (each takes required_samples prompts and runs require_batches x ppo_epochs
    optimizer steps): total_train_steps * trigger_parameter_sync_step."""

    def as_dict(self) -> dict[str, int]:
        return {
            "required_samples": self.required_samples,
            "max_required_samples": self.max_required_samples,
            "total_rollout_steps": self.total_rollout_steps,
            "total_train_steps": self.total_train_steps,
            "total_local_steps": self.total_local_steps,
        }


def required_samples(ppo_mini_batch_size: int, require_batches: int) -> int:
    """Prompts consumed per trainer step (require_batches mini-batches of ppo_mini_batch_size)."""
    return ppo_mini_batch_size * require_batches


def max_required_samples(required: int, staleness_threshold: float, trigger_parameter_sync_step: int) -> int:
    """verl's budget: prompts that may be issued between two version commits."""
    return int(required * (1 + staleness_threshold) * trigger_parameter_sync_step)


def derive(cfg: MeshConfig, dataset_size: int | None = None) -> Derived:
    """Derived run quantities. `dataset_size` caps the run at `dataset_size * rollout.total_epochs`
    prompts when known (verl: min(total_rollout_steps, len(dataloader) * total_epochs))."""
    at = cfg.async_training
    req = required_samples(cfg.actor_rollout_ref.actor.ppo_mini_batch_size, at.require_batches)
    max_req = max_required_samples(req, at.staleness_threshold, at.trigger_parameter_sync_step)
    total, train_steps = run_length(
        required=req, trigger=at.trigger_parameter_sync_step, total_rollout_steps=cfg.rollout.total_rollout_steps,
        total_epochs=cfg.rollout.total_epochs, total_training_steps=cfg.trainer.total_training_steps,
        dataset_size=dataset_size,
    )
    return Derived(
        required_samples=req,
        max_required_samples=max_req,
        total_rollout_steps=total,
        total_train_steps=train_steps,
        total_local_steps=train_steps * at.trigger_parameter_sync_step,
    )
