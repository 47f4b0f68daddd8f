"""RMSNorm modules for megatron's local (non-Transformer-Engine) layer spec that allow
sequence parallelism. megatron-core's `WrappedTorchNorm` refuses `sequence_parallel`, and its
MoE layer refuses to train with TP > 1 without it, so without TE a Qwen3-MoE could not train
with tensor parallelism at all. Under SP the hidden-state norms see a sequence shard, so their
weight gradients are partial per TP rank: marking the weight `sequence_parallel` makes
megatron's `finalize_model_grads` all-reduce them over TP (what TE's norms do)."""

from __future__ import annotations

from typing import Any

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """Hidden-state RMSNorm (input, pre-MLP, final)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


class HeadRMSNorm(torch.nn.RMSNorm):
    """Per-head q/k RMSNorm (never sees a sequence shard, so no SP marking)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)


def localize_norms(block_spec: Any) -> Any:
    """Replace megatron's WrappedTorchNorm in a local-spec decoder block spec (in place)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def swap(spec: Any, cls: type) -> Any:
        module = getattr(spec, "module", spec)
        return cls if module is WrappedTorchNorm else spec

    for layer in block_spec.layer_specs:
        sub = layer.submodules
        sub.input_layernorm = swap(sub.input_layernorm, SequenceParallelRMSNorm)
        sub.pre_mlp_layernorm = swap(sub.pre_mlp_layernorm, SequenceParallelRMSNorm)
        attn = getattr(sub.self_attention, "submodules", None)
        if attn is not None:
            attn.q_layernorm = swap(attn.q_layernorm, HeadRMSNorm)
            attn.k_layernorm = swap(attn.k_layernorm, HeadRMSNorm)
    if getattr(block_spec, "layer_norm", None) is not None:
        block_spec.layer_norm = swap(block_spec.layer_norm, SequenceParallelRMSNorm)
    return block_spec
