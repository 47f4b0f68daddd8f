"""What one megatron engine instance is told: the model, the `megatron` section, the optimizer.
Built from the run config with `MegatronEngineConfig.from_mesh`; the MindSpeed engine's config
subclasses this one (its validators run after these, never instead of them)."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, model_validator

from services.common.config.actor_rollout_ref import MegatronConfig, OptimConfig
from services.common.config.base import ConfigModel
from services.common.errors import ConfigError
from services.trainer.engines.optim import lr_lambda


class MegatronEngineConfig(ConfigModel):
    """One megatron training engine (actor, optionally with a frozen reference)."""

    model_path: str | None
    """Local HF checkpoint directory (config.json + safetensors); null: `model_init` builds one."""
    model_init: Any = Field(default=None, exclude=True)
    """Callable returning the initial HF model, used on rank 0 when `model_path` is null (the
    built-in tiny model, tests): it is saved to a temporary directory that every rank loads."""
    collective_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds before a collective is declared hung."""
    device: Literal["cuda", "npu", "cpu"] = "cuda"
    """Device kind; `cpu` only for tests (torch optimizer instead of megatron's)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter / compute dtype; the optimizer keeps fp32 master weights."""
    megatron: MegatronConfig = MegatronConfig()
    """Parallel layout, offload and pass-through overrides."""
    ref_megatron: MegatronConfig | None = None
    """Reference-policy options; null: no reference model."""
    optim: OptimConfig = OptimConfig()
    """AdamW and LR schedule."""
    grad_clip: float = 1.0
    """Max global gradient norm; <= 0: no clipping, as in the FSDP engine and in megatron's
    optimizer (`actor_rollout_ref.actor.grad_clip=0` is a valid run config)."""
    total_training_steps: int = Field(default=1, ge=1)
    """Optimizer steps the LR schedule spans."""
    gradient_checkpointing: bool = False
    """Full recompute of every layer (unless override_transformer_config sets recompute_*)."""
    log_prob_micro_batch_size: int | None = Field(default=None, ge=1)
    """Sequences per forward in compute_logprobs; null: the whole batch at once."""
    seed: int = 42
    """Seed of the RNG trackers."""

    @model_validator(mode="after")
    def _check_megatron(self) -> Self:
        if self.model_path is None and self.model_init is None:
            raise ConfigError("the megatron engine loads a HF checkpoint: set actor_rollout_ref.model.path")
        m = self.megatron
        if m.context_parallel_size > 1 and self.device == "cpu":
            raise ConfigError("context_parallel_size > 1 needs Transformer Engine attention (GPU) or MindSpeed (NPU)")
        ref = self.ref_megatron
        if ref is not None:
            keys = (
                "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
            )
            diff = [k for k in keys if getattr(ref, k) != getattr(m, k)]
            if diff:
                raise ConfigError(
                    f"actor_rollout_ref.ref.megatron.{diff[0]}={getattr(ref, diff[0])} differs from the actor's "
                    f"({getattr(m, diff[0])}); actor and reference share one parallel layout: set them equal"
                )
        if m.param_offload and not m.use_distributed_optimizer and self.device != "cpu":
            raise ConfigError(
                "actor_rollout_ref.actor.megatron.param_offload moves megatron's parameter buffers, which exist only with "
                "use_distributed_optimizer=true; enable it or turn param_offload off"
            )
        if m.optimizer_offload and m.use_distributed_optimizer and self.device != "cpu" and self.dtype == "float32":
            # megatron-core 0.16 hands fp32 parameters' shards to its CPU-offload optimizer as views
            # of the parameters (non-leaf tensors), which torch.optim refuses; with bf16/fp16 the
            # shards are fp32 master copies and offload works.
            raise ConfigError(
                "actor_rollout_ref.actor.megatron.optimizer_offload with the distributed optimizer needs bf16/fp16 "
                "parameters (megatron-core cannot offload fp32 parameter shards); set actor_rollout_ref.model.dtype="
                "bfloat16 or optimizer_offload=false"
            )
        tcfg = m.override_transformer_config
        first, last = tcfg.get("num_layers_in_first_pipeline_stage"), tcfg.get("num_layers_in_last_pipeline_stage")
        if (first is not None or last is not None) and m.pipeline_model_parallel_size == 1:
            raise ConfigError(
                "override_transformer_config.num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1"
            )
        return self

    @classmethod
    def from_spec(cls, spec: Any, **extra: Any) -> Self:
        """From the trainer's EngineSpec (services/trainer/engines/base.py on main): model, actor,
        ref, device, total_training_steps, log_prob_micro_batch_size_per_gpu, seed,
        collective_timeout_s, model_init."""
        return cls(
            model_path=spec.model.path,
            model_init=getattr(spec, "model_init", None),
            device=spec.device,
            dtype=spec.model.dtype,
            megatron=spec.actor.megatron,
            ref_megatron=spec.ref.megatron if spec.ref is not None else None,
            optim=spec.actor.optim,
            grad_clip=spec.actor.grad_clip,
            total_training_steps=_schedule_steps(spec.actor.optim, spec.total_training_steps),
            gradient_checkpointing=spec.model.enable_gradient_checkpointing,
            log_prob_micro_batch_size=spec.log_prob_micro_batch_size_per_gpu,
            seed=spec.seed,
            collective_timeout_s=getattr(spec, "collective_timeout_s", 600.0),
            **extra,
        )

    @classmethod
    def from_mesh(cls, cfg: Any, device: str, total_training_steps: int = 1, **extra: Any) -> Self:
        """From a MeshConfig (`actor_rollout_ref.*`)."""
        arr = cfg.actor_rollout_ref
        if arr.model.path is None:
            raise ConfigError("the megatron engine loads a HF checkpoint: set actor_rollout_ref.model.path")
        with_ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        return cls(
            model_path=arr.model.path,
            device=device,  # type: ignore[arg-type]
            dtype=arr.model.dtype,
            megatron=arr.actor.megatron,
            ref_megatron=arr.ref.megatron if with_ref else None,
            optim=arr.actor.optim,
            grad_clip=arr.actor.grad_clip,
            total_training_steps=_schedule_steps(arr.actor.optim, total_training_steps),
            gradient_checkpointing=arr.model.enable_gradient_checkpointing,
            log_prob_micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu,
            seed=cfg.trainer.seed,
            **extra,
        )


def _schedule_steps(optim: OptimConfig, total: int) -> int:
    """The schedule's step count, checked as the FSDP engine checks it (`lr_lambda` raises when a
    decaying schedule or a warmup ratio has no known total, or warmup covers the run). Clamped to
    1 unchecked, an open-ended run's cosine schedule decayed to min_lr (0 by default) after one step."""
    lr_lambda(optim, total)
    return max(1, total)
