"""MindSpeed's patch plan, as a pure function of the `megatron` config section.

MindSpeed (Ascend's megatron adaptor) is configured by a flat dict of feature flags given to
`mindspeed.megatron_adaptor.repatch(...)`, which must run before megatron's model-parallel
initialisation. verl builds it from `override_transformer_config`: `use_flash_attn` on (off when
`use_flash_attn_npu_batch_invariant`), `context_parallel_size` when CP > 1. meshrl does the same
and, in one pass, splits `override_transformer_config` into

    - megatron TransformerConfig fields  -> applied to TransformerConfig (as on GPU)
    - MindSpeed flags (table below)      -> the repatch dict
    - anything else                      -> ConfigError naming the key

so a typo is an error on NPU exactly as on GPU, and no key is silently dropped.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from services.common.config.actor_rollout_ref import MegatronConfig
from services.common.errors import ConfigError

# MindSpeed feature flags that are not megatron TransformerConfig fields (MindSpeed's
# arguments.py; the ones RL recipes on Ascend use). Values are passed through unchanged.
MINDSPEED_FLAGS: frozenset[str] = frozenset({
    "use_flash_attn", "use_flash_attn_npu_batch_invariant", "use_fusion_attn_v2", "sparse_mode",
    "use_fused_rmsnorm", "use_fused_swiglu", "use_fused_rotary_pos_emb", "use_fused_ring_attention_update",
    "context_parallel_algo", "ulysses_degree_in_cp", "cp_window_size", "use_cp_send_recv_overlap",
    "attention_mask_type", "reset_attention_mask", "reset_position_ids", "shape_order",
    "use_ascend_mc2", "use_ascend_coc", "moe_alltoall_overlap_comm", "moe_permutation_async_comm",
    "moe_tp_extend_ep", "moe_zero_memory", "gemm_gradient_accumulation_fusion", "use_fused_moe_token_permute_and_unpermute",
    "recompute_activation_function", "recompute_norm", "swap_attention", "swap_optimizer", "use_nanopipe",
    "use_naive_l2norm", "use_triton_gdn", "use_ascend_gdn", "kv_head_repeat_before_uly_alltoall",
    "npu_deterministic", "optimizer_selection", "use_mcore_models",
})

# Keys verl writes into the repatch dict itself (never taken from the user as a TransformerConfig field).
_DERIVED = ("use_flash_attn", "context_parallel_size")


@dataclass(frozen=True)
class PatchPlan:
    """What the MindSpeed engine applies, and where."""

    repatch: dict[str, Any]
    """The dict given to `mindspeed.megatron_adaptor.repatch` (before model-parallel init)."""
    transformer_overrides: dict[str, Any] = field(default_factory=dict)
    """The part of override_transformer_config that goes to megatron's TransformerConfig."""


def _attn_backend(value: Any) -> Any:
    """megatron's AttnBackend for a YAML string, as verl's mapping_string_to_attn_backend gives
    repatch (megatron's own argparse stores the enum in the global args MindSpeed reads)."""
    if not isinstance(value, str):
        return value
    from megatron.core.transformer.enums import AttnBackend

    try:
        return AttnBackend[value]
    except KeyError:
        raise ConfigError(
            f"override_transformer_config.attention_backend={value!r} is not one of {', '.join(b.name for b in AttnBackend)}"
        ) from None


def build_patch_plan(m: MegatronConfig, transformer_fields: set[str]) -> PatchPlan:
    """Split `m.override_transformer_config` and derive MindSpeed's repatch dict.
    `transformer_fields` is the set of megatron TransformerConfig field names."""
    repatch: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    for key, value in m.override_transformer_config.items():
        if key in MINDSPEED_FLAGS:
            repatch[key] = value
        elif key in transformer_fields:
            overrides[key] = value
            if key == "attention_backend":
                repatch[key] = _attn_backend(value)
        else:
            close = difflib.get_close_matches(key, sorted(MINDSPEED_FLAGS | transformer_fields), n=1, cutoff=0.7)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"actor_rollout_ref.actor.megatron.override_transformer_config.{key} is neither a megatron "
                f"TransformerConfig field nor a known MindSpeed flag{hint}"
            )
    batch_invariant = bool(repatch.get("use_flash_attn_npu_batch_invariant", False))
    if "use_flash_attn" not in repatch:
        repatch["use_flash_attn"] = not batch_invariant
    elif repatch["use_flash_attn"] and batch_invariant:
        raise ConfigError(
            "override_transformer_config: use_flash_attn_npu_batch_invariant needs use_flash_attn=false "
            "(the batch-invariant path replaces flash attention); drop one of them"
        )
    if m.context_parallel_size > 1:
        repatch["context_parallel_size"] = m.context_parallel_size
        repatch.setdefault("context_parallel_algo", "megatron_cp_algo")
    # Megatron-side parallel sizes MindSpeed's patches read from its global args.
    repatch.update(
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        expert_model_parallel_size=m.expert_model_parallel_size,
        sequence_parallel=m.sequence_parallel and m.tensor_model_parallel_size > 1,
        use_distributed_optimizer=m.use_distributed_optimizer,
    )
    return PatchPlan(repatch=repatch, transformer_overrides=overrides)
