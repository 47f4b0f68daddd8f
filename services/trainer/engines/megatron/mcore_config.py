"""From a HF architecture and `actor.megatron` to megatron-core's TransformerConfig,
OptimizerConfig and DistributedDataParallelConfig, with the user's overrides really applied.

The derivation is pure (`transformer_config_kwargs` returns a dict); `build_dataclass` then
constructs megatron's dataclass, rejecting unknown override keys by name and checking that every
override survived megatron's `__post_init__` (verl once shipped a release that dropped them).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from services.common.config.actor_rollout_ref import MegatronConfig
from services.common.errors import ConfigError
from services.common.logging import get_logger
from services.common.model_arch import ModelArch

log = get_logger(__name__)

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def transformer_config_kwargs(
    arch: ModelArch, m: MegatronConfig, *, dtype: str, cpu: bool, transformer_engine: bool = False
) -> dict[str, Any]:
    """TransformerConfig fields for a Qwen3 / Qwen3-MoE (or Llama-like) model, before overrides.
    Fusions that need apex / Transformer Engine / CUDA kernels are off; overrides may turn them on.
    Without TE the engine swaps megatron's torch norms for SP-capable ones (norms.py)."""
    import torch

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    tp = m.tensor_model_parallel_size
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size or arch.moe_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.attention_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        # Parallel layout.
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
        context_parallel_size=m.context_parallel_size,
        expert_model_parallel_size=m.expert_model_parallel_size,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size or tp,
        sequence_parallel=m.sequence_parallel and tp > 1,
        # Precision.
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        # Kernels that need apex / TE / CUDA are off by default.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=cpu,
        # Must stay on: megatron 0.16 sets the tensor-parallel attributes of linear weights
        # (used by grad-norm, clipping and checkpointing) only in its init path. The random
        # values are then replaced by the HF weights.
        perform_initialization=True,
        # Micro-batches differ in length; PP must then exchange shapes.
        variable_seq_lengths=m.pipeline_model_parallel_size > 1,
        # The interleaved (VPP) schedule sends to the previous and the next stage in one call. With
        # PP=2 both are the same rank, and megatron's batched p2p posts send_prev before send_next
        # on one communicator while the peer posts recv_prev before recv_next: NCCL and gloo match
        # them in order, so gradients land in activation buffers (grad norms 2000x off, seen on
        # CUDA and CPU). The unbatched path orders by rank parity over two communicators (what
        # Megatron-LM uses for VPP: overlap_p2p_comm on, batch_p2p_comm off).
        batch_p2p_comm=(m.virtual_pipeline_model_parallel_size or 1) <= 1,
        # Gradients are averaged by the engine's loss scaling contract (see engine.train_step).
        calculate_per_token_loss=False,
        # megatron refuses variable_seq_lengths with the allgather dispatcher even for dense
        # models; alltoall is the choice for MoE on GPU anyway (below).
        moe_token_dispatcher_type="alltoall",
    )
    if arch.is_moe:
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.num_experts_per_tok,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            moe_layer_freq=[1 if is_moe else 0 for is_moe in arch.moe_layers],
            moe_router_score_function="softmax",
            # Qwen3-MoE: softmax over all experts then top-k; with norm_topk_prob the top-k
            # weights are renormalised, which equals a softmax over the top-k logits.
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            # alltoall needs CUDA streams in megatron 0.16; allgather runs on CPU (tests).
            moe_token_dispatcher_type="allgather" if cpu else "alltoall",
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
        )
    return kw


def known_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def split_overrides(overrides: dict[str, Any], cls: type, extra_known: set[str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(fields of `cls`, keys in `extra_known`); any other key is an error naming the closest field."""
    fields = known_fields(cls)
    mine, extra = {}, {}
    for key, value in overrides.items():
        if key in fields:
            mine[key] = value
        elif extra_known is not None and key in extra_known:
            extra[key] = value
        else:
            close = difflib.get_close_matches(key, sorted(fields | (extra_known or set())), n=1, cutoff=0.7)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"override key {key!r} is not a field of megatron-core's {cls.__name__}{hint}")
    return mine, extra


# Settings whose megatron-core implementation lives in Transformer Engine.
NEEDS_TE = {"use_precision_aware_optimizer", "moe_permute_fusion", "moe_grouped_gemm", "fp8", "apply_rope_fusion"}


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _coerce_enums(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """YAML gives strings; megatron wants its enums (e.g. attention_backend: flash -> AttnBackend.flash)."""
    import enum

    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    out = dict(values)
    for key, value in values.items():
        default = defaults.get(key)
        if isinstance(default, enum.Enum) and isinstance(value, str):
            enum_cls = type(default)
            try:
                out[key] = enum_cls[value]
            except KeyError:
                raise ConfigError(
                    f"{key}={value!r} is not one of {', '.join(m.name for m in enum_cls)}"
                ) from None
    return out


def build_dataclass(cls: type, base: dict[str, Any], overrides: dict[str, Any], section: str) -> Any:
    """cls(**base | overrides), and a check that megatron kept every override."""
    mine, _ = split_overrides(overrides, cls)
    mine = _coerce_enums(cls, mine)
    kwargs = {**base, **mine}
    te_only = sorted(k for k in NEEDS_TE if mine.get(k))
    if te_only and not has_transformer_engine():
        raise ConfigError(
            f"{section}.{te_only[0]}=true needs NVIDIA Transformer Engine, which is not installed; "
            f"install transformer-engine or set it to false"
        )
    try:
        obj = cls(**kwargs)
    except (ValueError, AssertionError, TypeError) as exc:
        raise ConfigError(f"{section}: megatron-core rejected the configuration: {exc}") from exc
    for key, value in mine.items():
        got = getattr(obj, key)
        if got != value and not (callable(value) or callable(got)):
            log.warning("megatron changed an override", section=section, key=key, asked=value, got=got)
    return obj


def optimizer_config_kwargs(optim: Any, m: MegatronConfig, *, dtype: str, grad_clip: float) -> dict[str, Any]:
    """OptimizerConfig fields from `actor.optim` (AdamW) and the offload flags."""
    kw: dict[str, Any] = dict(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.lr * optim.min_lr_ratio,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=grad_clip,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        use_distributed_optimizer=m.use_distributed_optimizer,
    )
    import torch

    kw["params_dtype"] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if m.optimizer_offload:
        kw.update(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    return kw


def ddp_config_kwargs(m: MegatronConfig) -> dict[str, Any]:
    return dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=m.use_distributed_optimizer,
        average_in_collective=False,
    )
