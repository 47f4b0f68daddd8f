"""Hugging Face models for the training engines: config with overrides, compatibility checks
(packing, Ulysses), and construction on rank 0 (real weights) or on the meta device (others).

Which models can be packed: any decoder whose attention is standard softmax attention, since
transformers turns restarting `position_ids` into a block-diagonal mask (sdpa) or varlen
kernels (flash). Models with gated delta-net / linear-attention layers (Qwen3.5, Qwen3-Next)
carry a recurrent state along the row and need one sequence per row.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from services.common.config.actor_rollout_ref import ActorConfig, ModelConfig
from services.common.errors import ConfigError

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def text_config(hf_config: Any) -> Any:
    """The language-model part of a (possibly multimodal) config."""
    return getattr(hf_config, "text_config", None) or hf_config


def linear_attention_layers(hf_config: Any) -> int:
    """How many layers are gated delta-net / linear attention."""
    types = getattr(text_config(hf_config), "layer_types", None) or []
    return sum(1 for t in types if t == "linear_attention")


def apply_overrides(hf_config: Any, overrides: dict[str, Any], where: str = "actor_rollout_ref.model.override_config") -> None:
    """Set override_config keys on the HF config; a key the config lacks is an error (a typo
    would otherwise silently do nothing)."""
    for key, value in overrides.items():
        target = hf_config
        if not hasattr(target, key) and hasattr(text_config(hf_config), key):
            target = text_config(hf_config)
        if not hasattr(target, key):
            known = sorted(k for k in vars(text_config(hf_config)) if "dropout" in k)
            raise ConfigError(
                f"{where}.{key}: the {getattr(hf_config, 'model_type', '?')} config has no field {key!r}"
                f" (dropout fields it has: {known})"
            )
        current = getattr(target, key)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            apply_overrides(current, value, f"{where}.{key}")
        else:
            setattr(target, key, value)


def load_config(model: ModelConfig) -> Any:
    """The HF config of `model.path` with override_config applied."""
    from transformers import AutoConfig

    assert model.path is not None
    cfg = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    apply_overrides(cfg, model.override_config)
    return cfg


def check_compat(hf_config: Any, model: ModelConfig, actor: ActorConfig) -> None:
    """Reject configurations the model cannot train with, naming the fix."""
    kind = getattr(hf_config, "model_type", "this model")
    gdn = linear_attention_layers(hf_config)
    if gdn and model.use_remove_padding:
        raise ConfigError(
            f"actor_rollout_ref.model.use_remove_padding=true is not supported for {kind}: its {gdn} gated "
            "delta-net (linear attention) layers need unpacked batches; set "
            "actor_rollout_ref.model.use_remove_padding=false"
        )
    sp = actor.ulysses_sequence_parallel_size
    if sp > 1:
        if gdn:
            raise ConfigError(
                f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} is not supported for {kind}: its "
                "gated delta-net layers need whole sequences; set ulysses_sequence_parallel_size=1"
            )
        tc = text_config(hf_config)
        heads, kv = tc.num_attention_heads, getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
        if heads % sp or (kv % sp and sp % kv):
            raise ConfigError(
                f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} must divide the attention heads "
                f"({heads}) and divide or be a multiple of the KV heads ({kv})"
            )


def attn_implementation(device: str, compute_dtype: torch.dtype) -> str:
    """flash_attention_2 on CUDA when flash-attn is installed and compute is bf16/fp16, else sdpa."""
    half = compute_dtype in (torch.bfloat16, torch.float16)
    if device == "cuda" and half and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def master_dtype(model: ModelConfig, actor: ActorConfig) -> torch.dtype:
    """fsdp_config.model_dtype when set, else model.dtype."""
    fsdp = actor.fsdp_config
    return DTYPES[fsdp.model_dtype] if fsdp.model_dtype is not None else DTYPES[model.dtype]


def build_model(
    model: ModelConfig,
    hf_config: Any,
    *,
    dtype: torch.dtype,
    attn: str,
    materialize: bool,
    model_init: Any = None,
) -> Any:
    """The causal LM. `materialize`: load real weights (rank 0); otherwise build on the meta
    device (weights arrive by broadcast after sharding)."""
    from transformers import AutoModelForCausalLM

    if not materialize:
        with torch.device("meta"):
            # trust_remote_code on every rank: only the one that loaded the checkpoint has the class
            return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn,
                                                    trust_remote_code=model.trust_remote_code)
    if model.path is not None:
        return AutoModelForCausalLM.from_pretrained(
            model.path, config=hf_config, dtype=dtype, attn_implementation=attn, trust_remote_code=model.trust_remote_code
        )
    assert model_init is not None, "model.path is null and no model_init was given"
    init = model_init()
    fresh = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn,
                                             trust_remote_code=model.trust_remote_code)
    fresh.load_state_dict(init.state_dict())
    fresh.generation_config = init.generation_config
    return fresh


def config_from_init(model: ModelConfig, model_init: Any) -> Any:
    """The HF config of a model built by `model_init`, with override_config applied."""
    import copy

    cfg = copy.deepcopy(model_init().config)
    apply_overrides(cfg, model.override_config)
    return cfg
