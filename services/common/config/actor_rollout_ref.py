"""`actor_rollout_ref.*`: the model, the actor (trainer), the rollout engine and the reference
policy. Keys and defaults follow verl's `ppo_trainer.yaml` / `fully_async_ppo_trainer.yaml`."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import ConfigModel


class ModelConfig(ConfigModel):
    """The policy model, shared by actor, rollout and reference."""

    path: str | None = None
    """Hugging Face checkpoint: a local directory or a hub id (`Qwen/Qwen3-8B`, resolved by
    `meshrl train` through huggingface_hub's cache; HF_HUB_OFFLINE honoured). Null: the built-in
    tiny model (built or warm-started by `meshrl pretrain`, cached in the user cache dir)."""
    tokenizer_path: str | None = None
    """Tokenizer directory or hub id; defaults to `path`."""
    override_config: dict[str, Any] = {}
    """Overrides applied to the HF config before building the model (e.g. dropout)."""
    use_remove_padding: bool = True
    """Train on packed varlen batches. Must be false for Qwen3.5 (gated delta-net layers)."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward."""
    trust_remote_code: bool = False
    """Allow custom modeling code from the checkpoint directory."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training (mixed precision is engine-specific)."""
    lora_rank: int = Field(default=0, ge=0)
    """LoRA rank (verl's name); 0: train the full weights. > 0: the `fsdp` engine trains a PEFT
    adapter of this rank on the frozen base, and every weight version is the adapter alone."""
    lora_alpha: int = Field(default=16, gt=0)
    """LoRA scaling numerator: the update is (lora_alpha / lora_rank) * B @ A."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get an adapter: `all-linear` (every linear layer but the output head) or a
    list of module names / suffixes (e.g. [q_proj, v_proj])."""
    exclude_modules: str | list[str] | None = None
    """Modules never adapted (a regex string or a list of names), applied after `target_modules`."""
    lora_adapter_path: str | None = None
    """Start from this PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
    instead of a fresh adapter; its rank must equal `lora_rank`."""
    lora_export_merged: bool = False
    """With LoRA: the final HF export also holds the base with the adapter merged in (a plain
    Hugging Face checkpoint, loadable without peft) under `merged/`, beside the PEFT adapter."""

    @model_validator(mode="after")
    def _lora(self) -> ModelConfig:
        where = "actor_rollout_ref.model"
        if self.lora_rank == 0:
            if self.lora_adapter_path is not None:
                raise ValueError(
                    f"{where}.lora_adapter_path is set but {where}.lora_rank=0 (LoRA off); set {where}.lora_rank "
                    "to the adapter's rank (its adapter_config.json `r`)"
                )
            return self
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError(f"{where}.target_modules is an empty list: no module would train; use all-linear or name modules")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ValueError(
                f"{where}.target_modules={self.target_modules!r}: use all-linear or a list of module names "
                "(e.g. [q_proj, k_proj, v_proj, o_proj])"
            )
        return self


class OptimConfig(ConfigModel):
    """AdamW and the LR schedule. The schedule's total step count is fixed before the optimizer
    is built (derived from `rollout.total_rollout_steps` unless set)."""

    lr: float = Field(default=1e-6, ge=0)
    """Peak learning rate."""
    lr_warmup_steps: int = -1
    """Warmup steps; negative: use `lr_warmup_steps_ratio`."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup as a fraction of total training steps."""
    lr_scheduler_type: Literal["constant", "cosine", "linear"] = "constant"
    """Schedule after warmup."""
    min_lr_ratio: float = 0.0
    """Floor of cosine/linear decay as a fraction of `lr`."""
    num_cycles: float = 0.5
    """Cosine cycles."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    total_training_steps: int = -1
    """Optimizer steps for the schedule; negative: derived from the run length."""



class FSDPConfig(ConfigModel):
    """FSDP2 options (verl `fsdp_config`)."""

    param_offload: bool = False
    """Keep parameters on CPU between uses."""
    optimizer_offload: bool = False
    """Keep optimizer state on CPU."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3 style)."""
    fsdp_size: int = -1
    """Ranks per FSDP shard group; -1: all ranks."""
    model_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    """Master parameter dtype; null: `actor_rollout_ref.model.dtype` (a null survives a dumped
    config, which the services and --resume load again)."""
    mixed_precision: Literal["none", "bf16", "fp16"] = "none"
    """Compute dtype for forward/backward."""


class MegatronConfig(ConfigModel):
    """Megatron-core / MindSpeed options (verl `actor.megatron`, `ref.megatron`). Used when
    `actor.strategy` is `megatron` or `mindspeed`. Devices split as
    world = TP x PP x CP x DP; experts as world = ETP x EP x expert-DP (per PP stage)."""

    tensor_model_parallel_size: int = Field(default=1, ge=1)
    """Tensor-parallel degree (TP)."""
    pipeline_model_parallel_size: int = Field(default=1, ge=1)
    """Pipeline-parallel stages (PP). Uneven first/last stages: set
    `override_transformer_config.num_layers_in_first_pipeline_stage` / `..._last_...`."""
    virtual_pipeline_model_parallel_size: int | None = Field(default=None, ge=1)
    """Model chunks per pipeline stage (interleaved schedule, VPP); null: 1."""
    context_parallel_size: int = Field(default=1, ge=1)
    """Context-parallel degree (CP): the sequence split across ranks (needs Transformer Engine
    attention on GPU, MindSpeed on NPU)."""
    expert_model_parallel_size: int = Field(default=1, ge=1)
    """Expert-parallel degree (EP); must divide the model's expert count."""
    expert_tensor_parallel_size: int | None = Field(default=None, ge=1)
    """Tensor-parallel degree inside each expert (ETP); null: same as TP."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism (shard activations of norms/dropout over TP); only takes
    effect when TP > 1."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    use_dist_checkpointing: bool = False
    """Save/load with megatron's distributed (resharding) checkpoint format."""
    dist_checkpointing_path: str | None = None
    """Initial weights in dist-checkpoint format instead of the HF checkpoint."""
    param_offload: bool = False
    """Move parameters (megatron's param buffers) to CPU between uses."""
    grad_offload: bool = False
    """Free gradient buffers on the device between optimizer steps."""
    optimizer_offload: bool = False
    """Keep optimizer state on CPU (megatron-core's `optimizer_cpu_offload`)."""
    seed: int = 42
    """Seed for megatron's model-parallel RNG trackers."""
    use_mbridge: bool = False
    """Convert HF <-> megatron weights with Megatron-Bridge / mbridge when installed; otherwise
    (or false) meshrl's own name map for Qwen3 / Qwen3-MoE is used."""
    vanilla_mbridge: bool = True
    """With `use_mbridge`: the original mbridge package (true) or NVIDIA Megatron-Bridge (false)."""
    use_remove_padding: bool = True
    """Pack sequences (THD) for attention; must be false for gated delta-net models (Qwen3.5)."""
    override_transformer_config: dict[str, Any] = {}
    """Fields set on megatron-core's TransformerConfig after meshrl derives it from the HF config
    (e.g. recompute_granularity, num_layers_in_first_pipeline_stage, moe_token_dispatcher_type).
    Unknown keys are rejected; on `mindspeed` MindSpeed's own flags (use_flash_attn, ...) are
    passed to its repatch."""
    override_optimizer_config: dict[str, Any] = {}
    """Fields set on megatron-core's OptimizerConfig (e.g. optimizer_offload_fraction,
    overlap_cpu_optimizer_d2h_h2d, use_precision_aware_optimizer). Unknown keys are rejected."""
    override_ddp_config: dict[str, Any] = {}
    """Fields set on megatron-core's DistributedDataParallelConfig (e.g. bucket_size)."""

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the dense model: TP x PP x CP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


class PolicyLossConfig(ConfigModel):
    """verl `actor.policy_loss`."""

    loss_mode: Literal["vanilla", "gspo"] = "vanilla"
    """`vanilla` = PPO clip (with dual clip); `gspo` = sequence-level ratio, aggregated with
    `loss_agg_mode` as in verl 0.9.1 (`seq-mean-token-mean` gives the paper's objective)."""


class CheckpointContentsConfig(ConfigModel):
    """What a checkpoint holds."""

    save_contents: list[Literal["model", "optimizer", "extra", "hf_model"]] = ["model", "optimizer", "extra"]
    """Parts to save; `model` and `extra` (the step, the LR schedule, RNG) always: the coordinator
    counts a checkpoint's groups as trained once it is saved, so it must be one a run resumes from."""
    load_contents: list[Literal["model", "optimizer", "extra", "hf_model"]] | None = None
    """Parts to load on resume; null: `save_contents` (verl's `${.save_contents}`). Only parts that
    are saved, `model` and `extra` among them."""

    @model_validator(mode="after")
    def _resumable(self) -> CheckpointContentsConfig:
        where = "actor_rollout_ref.actor.checkpoint"
        if self.load_contents is None:
            self.load_contents = [c for c in self.save_contents if c != "hf_model"]
        for name, parts in (("save_contents", self.save_contents), ("load_contents", self.load_contents)):
            missing = [c for c in ("model", "extra") if c not in parts]
            if missing:
                raise ValueError(f"{where}.{name}={list(parts)} lacks {missing}: a checkpoint must resume the model "
                                 "and the trainer's step; add them")
        unsaved = [c for c in self.load_contents if c not in self.save_contents]
        if unsaved:
            raise ValueError(f"{where}.load_contents={list(self.load_contents)} loads {unsaved}, which "
                             f"{where}.save_contents={list(self.save_contents)} does not save; drop them, or save them")
        return self


class ActorConfig(ConfigModel):
    """The trained policy (verl `actor_rollout_ref.actor`)."""

    strategy: Literal["fsdp", "fsdp2", "megatron", "mindspeed"] = "fsdp2"
    """Training engine backend; `fsdp` is an alias of `fsdp2`."""
    ppo_mini_batch_size: int = Field(default=256, ge=1)
    """Prompts per optimizer step (each with `rollout.n` responses)."""
    ppo_micro_batch_size_per_gpu: int | None = Field(default=None, ge=1)
    """Sequences per forward/backward on one rank; null: the whole mini-batch (0 was taken as
    null and a negative size gave no micro-batch at all: both refused)."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token budget instead of a fixed count."""
    ppo_max_token_len_per_gpu: int = Field(default=16384, ge=1)
    """Token budget of a micro-batch when `use_dynamic_bsz`."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each mini-batch (0 would run no optimizer step: a run that trains nothing)."""
    shuffle: bool = False
    """Shuffle sequences across micro-batches."""
    clip_ratio: float = 0.2
    """PPO clip epsilon (default for `clip_ratio_low/high`)."""
    clip_ratio_low: float | None = None
    """Lower clip epsilon; null: `clip_ratio`."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon (DAPO clip-higher); null: `clip_ratio`."""
    clip_ratio_c: float = Field(default=3.0, gt=1.0)
    """Dual-clip constant for negative advantages (> 1)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How token losses are aggregated."""
    loss_scale_factor: int | None = Field(default=None, ge=1)
    """Divisor of `seq-mean-token-sum-norm` (Dr.GRPO's constant); null: data.max_response_length."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient."""
    use_kl_loss: bool = False
    """Add a KL(policy || reference) loss term."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: Literal[
        "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+"
    ] = "low_var_kl"
    """KL estimator: k1 (`kl`), `abs`, k2 (`mse`), k3 (`low_var_kl`). A `+` suffix keeps the
    estimator's value but takes k2's (unbiased) gradient, straight-through (verl)."""
    grad_clip: float = 1.0
    """Max gradient norm; 0 or less: no clipping."""
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    """Policy loss variant."""
    use_rollout_log_probs: bool = True
    """Use the rollout's logprobs as old logprobs (bypass mode)."""
    ulysses_sequence_parallel_size: int = Field(default=1, ge=1)
    """Ulysses sequence-parallel degree (all-to-all over attention heads)."""
    freeze_vision_tower: bool = True
    """Released multimodal checkpoints (Qwen3.5 as released): keep the vision tower frozen and
    carry it through to the export (services/common/released.py). meshrl trains on text, which
    gives the vision tower no gradient, so this must stay true (verl's default is false)."""
    optim: OptimConfig = OptimConfig()
    """Optimizer and schedule."""
    fsdp_config: FSDPConfig = FSDPConfig()
    """FSDP2 options."""
    megatron: MegatronConfig = MegatronConfig()
    """Megatron-core options (strategy `megatron` / `mindspeed`)."""
    checkpoint: CheckpointContentsConfig = CheckpointContentsConfig()
    """Checkpoint contents."""

    @field_validator("grad_clip")
    @classmethod
    def _grad_clip_not_nan(cls, v: float) -> float:
        # Both engines clip only where grad_clip > 0, and NaN > 0 is false: a NaN trained the
        # whole run without clipping, silently.
        if math.isnan(v):
            raise ValueError(f"grad_clip={v} is not a number; set a max gradient norm (1.0 is the default), or 0 for no clipping")
        return v

    @model_validator(mode="after")
    def _fsdp_fp16(self) -> ActorConfig:
        # fp16 gradients of a loss divided by the mini-batch's token count underflow unless the
        # loss is scaled, as verl does with a ShardedGradScaler; the FSDP engine has none.
        # Megatron's optimizer scales its own.
        fsdp = self.fsdp_config
        if self.strategy in ("fsdp", "fsdp2") and "fp16" in (fsdp.mixed_precision, fsdp.model_dtype):
            key = "mixed_precision" if fsdp.mixed_precision == "fp16" else "model_dtype"
            raise ValueError(
                f"actor_rollout_ref.actor.fsdp_config.{key}=fp16: the FSDP engine trains without loss "
                "scaling, so fp16 gradients underflow; use bf16 (or strategy=megatron, whose optimizer "
                "scales the loss)"
            )
        return self


class ValKwargs(ConfigModel):
    """Sampling for validation (verl `rollout.val_kwargs`)."""

    # Bounded as the engines' sampling check (SamplingSpec.validate) bounds them: a value it
    # refuses failed every validation Generate, first at a test_freq step hours into the run.
    temperature: float = Field(default=0.0, ge=0)
    """0 = greedy (with do_sample=true too); vllm: 0 or >= 0.01."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus threshold."""
    top_k: int = Field(default=-1, ge=-1)
    """-1 disables top-k."""
    n: int = Field(default=1, ge=1)
    """Samples per validation prompt."""
    do_sample: bool = False
    """Sample (true) or decode greedily (false)."""


VLLM_MIN_TEMPERATURE = 1e-2
"""vLLM's SamplingParams raises a temperature in (0, 1e-2) to 1e-2 (sampling and logprobs), so
the vllm engine refuses one (services/rollout/engines/vllm_engine.py)."""

COLLECTIVE_BACKENDS = ("nccl", "hccl", "gloo")
"""`checkpoint_engine.backend` values that broadcast every version to every rollout rank."""


class CheckpointEngineConfig(ConfigModel):
    """How weights reach this rollout group (verl `rollout.checkpoint_engine`)."""

    backend: Literal["grpc", "object_store", "nccl", "hccl", "disk", "gloo"] = "grpc"
    """Transport from the param server (see services/weights/transports): grpc (any two
    processes, any vendors), object_store (Ray, same cluster), nccl/hccl (broadcast from trainer
    rank 0 to same-kind devices), disk (shared filesystem), gloo (the CPU twin of nccl)."""
    update_weights_bucket_megabytes: int = 2048
    """Bucket size for weight transfer."""


class MultiTurnConfig(ConfigModel):
    """Multi-turn trajectories with tools and environments (verl `rollout.multi_turn`, same names
    and meanings). Environments themselves are configured under `environment.*`."""

    enable: bool = False
    """Play each prompt out over turns: assistant turns alternate with environment/tool/user
    messages (loss mask 0), until the environment says done or a limit is reached."""
    max_assistant_turns: int | None = Field(default=None, ge=1)
    """Most assistant (policy) turns per trajectory; null: no limit besides the token budget."""
    max_user_turns: int | None = Field(default=None, ge=1)
    """Most environment/user turns per trajectory; null: no limit."""
    max_parallel_calls: int = Field(default=1, ge=1)
    """Tool calls of one assistant turn run concurrently, at most this many (more are answered
    with an error message)."""
    tool_timeout_s: float | None = Field(default=600.0, gt=0)
    """meshrl: an in-process tool's `execute` running longer is cancelled and answered with an
    error message (counted in tool_errors; the episode goes on); any other call of a tool or an
    interaction (create, calc_reward, release, generate_response, ...) running longer fails the
    group (its prompt is re-queued). null: no limit (a hung tool then holds its group and lease
    forever). External environments have their endpoint's `timeout_s` instead."""
    max_tool_response_length: int = Field(default=256, ge=1)
    """Characters of one tool response (role `tool`) kept; longer ones are truncated. As in verl,
    other environment messages (an interaction's user turns) are not cut by it."""
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    """What is kept of a long tool response (verl): `left` its start, `right` its end,
    `middle` both ends."""
    tool_config_path: str | None = None
    """verl tool YAML (`tools: [{class_name, config, tool_schema}]`) for the in-process tool
    environment."""
    interaction_config_path: str | None = None
    """verl interaction YAML (`interaction: [{name, class_name, config}]`): simulated users that
    answer turns without tool calls."""
    use_inference_chat_template: bool = False
    """verl: render the history with the chat template used for inference. meshrl always
    continues from the exact sampled ids and renders only new messages, so this changes nothing;
    accepted for verl configs."""
    tokenization_sanity_check_mode: Literal["disable", "strict", "ignore_strippable"] = "strict"
    """Compare the incrementally built token ids with a full re-tokenization of the conversation
    at the end of each trajectory and report drift (`strict`: any difference; `ignore_strippable`:
    differences of whitespace only are ignored); never changes the trajectory."""
    format: Literal["hermes"] = "hermes"
    """Tool-call format: hermes / Qwen3 `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

    @field_validator("tool_config_path", "interaction_config_path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        # Replicas run in other working directories: a relative path that exists here is made
        # absolute where the config is loaded (the driver, `meshrl train` / `serve-config`).
        if value and not os.path.isabs(value) and os.path.exists(value):
            return os.path.abspath(value)
        return value


class RolloutEngineConfig(ConfigModel):
    """The inference engine (verl `actor_rollout_ref.rollout`)."""

    name: Literal["transformers", "vllm"] = "transformers"
    """Engine: `transformers` (CPU/GPU) or `vllm` (GPU; vllm-ascend on NPU)."""
    mode: Literal["async"] = "async"
    """Only async server mode exists in meshrl."""
    n: int = Field(default=4, ge=1)
    """Responses per prompt."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus threshold."""
    top_k: int = Field(default=-1, ge=-1)
    """-1 disables top-k."""
    seed: int | None = None
    """Base sampling seed (per-group seeds derive from it); null: random."""
    stop: list[str] = []
    """Stop strings."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    """Inference dtype."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1)
    """vLLM: fraction of device memory for weights + KV."""
    tensor_model_parallel_size: int = Field(default=1, ge=1)
    """Rollout TP degree."""
    data_parallel_size: int = Field(default=1, ge=1)
    """Rollout DP degree inside one engine."""
    expert_parallel_size: int = Field(default=1, ge=1)
    """Rollout EP degree (MoE): 1 (off) or the engine's TP x DP, which vLLM's expert parallelism
    always spans (it has no size of its own; > 1 turns on `enable_expert_parallel`)."""
    max_num_seqs: int = 256
    """Concurrent sequences per engine."""
    max_num_batched_tokens: int = 8192
    """Token budget per engine step (chunked prefill)."""
    max_model_len: int | None = None
    """Context length; null: prompt + response length."""
    enable_chunked_prefill: bool = True
    """vLLM chunked prefill."""
    enable_prefix_caching: bool = True
    """vLLM prefix caching (reset on every weight update)."""
    enforce_eager: bool = False
    """Disable CUDA graphs / compilation."""
    free_cache_engine: bool = True
    """Release KV cache memory during weight updates."""
    calculate_log_probs: bool = True
    """Return per-token logprobs (required for fully async)."""
    engine_kwargs: dict[str, dict[str, Any]] = {}
    """Extra engine arguments by engine name, passed through (e.g. `vllm: {compilation_config: ...}`)."""
    val_kwargs: ValKwargs = ValKwargs()
    """Validation sampling."""
    checkpoint_engine: CheckpointEngineConfig = CheckpointEngineConfig()
    """Weight transport."""
    log_prob_micro_batch_size_per_gpu: int | None = Field(default=None, ge=1)
    """Micro-batch for recomputing logprobs (decoupled mode)."""
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    """Multi-turn trajectories with tools and environments."""

    @field_validator("engine_kwargs")
    @classmethod
    def _vllm_parallel_sizes(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        # vllm_args.py passes these over the top-level sizes, and the launch checks read them
        # (meshrl.plan_layout.rollout_parallel): one that is no device count crashed there
        # (ZeroDivisionError, int()'s ValueError) instead of naming the key.
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            size = value.get("vllm", {}).get(name)
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.{name}={size!r}: must be a whole "
                                 "number >= 1 (the engine's devices along it)")
        return value

    def vllm_parallel(self) -> dict[str, tuple[str, int]]:
        """The vLLM engine's TP, DP and PP as it runs them, each as (the key that sets it, size):
        vllm_args.py passes the top-level sizes and then engine_kwargs.vllm over them."""
        vllm = self.engine_kwargs.get("vllm", {})

        def size(vllm_key: str, key: str, value: int) -> tuple[str, int]:
            if vllm_key in vllm:
                return f"actor_rollout_ref.rollout.engine_kwargs.vllm.{vllm_key}", int(vllm[vllm_key])
            return f"actor_rollout_ref.rollout.{key}", value

        return {
            "tp": size("tensor_parallel_size", "tensor_model_parallel_size", self.tensor_model_parallel_size),
            "dp": size("data_parallel_size", "data_parallel_size", self.data_parallel_size),
            "pp": size("pipeline_parallel_size", "engine_kwargs.vllm.pipeline_parallel_size", 1),
        }

    @model_validator(mode="after")
    def _vllm_expert_parallel(self) -> RolloutEngineConfig:
        # vLLM has no expert-parallel size: enable_expert_parallel (which expert_parallel_size > 1
        # turns on, vllm_args.py) spreads the experts over the engine's TP x DP ranks (verl asserts
        # the same). EP 8 at TP 8 x DP 8 silently ran EP 64 while the config and the plan said 8.
        ep = self.expert_parallel_size
        if self.name != "vllm" or ep == 1:
            return self  # the transformers engine reads no parallel size
        sizes = self.vllm_parallel()
        (tp_key, tp), (dp_key, dp) = sizes["tp"], sizes["dp"]
        if ep != tp * dp:
            key = "actor_rollout_ref.rollout.expert_parallel_size"
            raise ValueError(
                f"{key}={ep}: vLLM has no expert-parallel size; its expert parallelism (on for {key} > 1) spreads the "
                f"experts over the engine's TP x DP = {tp_key}({tp}) x {dp_key}({dp}) = {tp * dp} ranks; set "
                f"{key}={tp * dp} (or 1 for none), or change the engine's TP / DP"
            )
        return self

    @model_validator(mode="after")
    def _training_temperature(self) -> RolloutEngineConfig:
        # The training samples' temperature: the trainer recomputes log-probs at it (logits / t),
        # so 0 gives NaN and every step is skipped; a negative one, or one vLLM would raise, is
        # refused by the engine as bad input, which stops each replica that leases a prompt.
        key, t = "actor_rollout_ref.rollout.temperature", self.temperature
        if not t > 0:
            raise ValueError(
                f"{key}={t}: training samples need a temperature > 0 (the trainer divides the logits by it); "
                "greedy decoding is for validation: actor_rollout_ref.rollout.val_kwargs.do_sample=false"
            )
        # inf loaded (YAML .inf, an override "inf"): the transformers engine then samples uniformly
        # and the trainer's log-probs are all -log(vocab), a run that learns nothing.
        if not math.isfinite(t):
            raise ValueError(f"{key}={t}: must be finite; set it >= {VLLM_MIN_TEMPERATURE} (1.0 samples as the model does)")
        if self.name == "vllm" and t < VLLM_MIN_TEMPERATURE:
            raise ValueError(f"{key}={t}: vLLM samples below {VLLM_MIN_TEMPERATURE} at {VLLM_MIN_TEMPERATURE}, "
                             f"so the logprobs would not be those of {t}; set it >= {VLLM_MIN_TEMPERATURE}")
        # vLLM's floor for every engine: the trainer divides the float32 logits by it, which
        # overflows below ~1e-37 (NaN loss on every step), and well above that the log-probs
        # (-1e31 at 1e-30) make every importance ratio 0 or inf; the transformers engine would
        # sample such a temperature as greedy, not as logits / t.
        if t < VLLM_MIN_TEMPERATURE:
            raise ValueError(f"{key}={t}: the trainer's log-probs (logits / temperature) are not usable below "
                             f"{VLLM_MIN_TEMPERATURE} (vLLM's floor); set it >= {VLLM_MIN_TEMPERATURE}")
        # Validation sends its temperature only with do_sample (else 0, greedy); the vllm engine
        # refuses one in (0, 0.01), which failed every validation Generate.
        v = self.val_kwargs
        if not math.isfinite(v.temperature):
            # inf samples uniformly: every validation score would be that of noise
            raise ValueError(f"actor_rollout_ref.rollout.val_kwargs.temperature={v.temperature}: must be finite; "
                             f"set it to 0 (greedy) or >= {VLLM_MIN_TEMPERATURE}")
        if self.name == "vllm" and v.do_sample and 0 < v.temperature < VLLM_MIN_TEMPERATURE:
            raise ValueError(f"actor_rollout_ref.rollout.val_kwargs.temperature={v.temperature}: vLLM samples below "
                             f"{VLLM_MIN_TEMPERATURE} at {VLLM_MIN_TEMPERATURE}; set it to 0 (greedy) or >= {VLLM_MIN_TEMPERATURE}")
        return self



class RefConfig(ConfigModel):
    """The frozen reference policy for the KL loss."""

    fsdp_config: FSDPConfig = FSDPConfig()
    """Reference FSDP options (`param_offload` keeps it on CPU between uses)."""
    megatron: MegatronConfig = MegatronConfig()
    """Reference megatron options (same parallel layout as the actor; `param_offload` keeps it
    on CPU between uses)."""
    log_prob_micro_batch_size_per_gpu: int | None = Field(default=None, ge=1)
    """Micro-batch for reference logprobs."""
    ulysses_sequence_parallel_size: int = Field(default=1, ge=1)
    """Ulysses degree for the reference."""


class ActorRolloutRefConfig(ConfigModel):
    """verl's `actor_rollout_ref` section."""

    hybrid_engine: bool = False
    """Colocated actor+rollout; meshrl always separates them (must be false)."""
    model: ModelConfig = ModelConfig()
    """The policy model."""
    actor: ActorConfig = ActorConfig()
    """Training side."""
    rollout: RolloutEngineConfig = RolloutEngineConfig()
    """Inference side."""
    ref: RefConfig = RefConfig()
    """Reference policy."""
    nccl_timeout: int = Field(default=600, ge=1)
    """Seconds before a collective is declared hung."""

    @field_validator("hybrid_engine")
    @classmethod
    def _no_hybrid(cls, value: bool) -> bool:
        if value:
            raise ValueError("meshrl runs rollout and training on separate resources; set actor_rollout_ref.hybrid_engine=false")
        return value
