"""Tiny models of each recipe's architecture and the miniature recipe configs
(configs/recipes/mini/*.yaml): the same keys as the full recipes, resources scaled to a CPU or a
2-GPU machine."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MINI_DIR = ROOT / "configs" / "recipes" / "mini"

# recipe -> architecture of its tiny stand-in
MINI_ARCH = {
    "qwen3_235b_a22b_grpo_megatron_npu": "qwen3_moe",
    "qwen3_30b_a3b_dapo_fsdp_npu": "qwen3_moe",
    "qwen3_5_122b_a10b_grpo_megatron": "qwen3_5_moe_text",
    "qwen3_8b_grpo_mindspeed_npu": "qwen3",
    "qwen3_5_27b_grpo_fsdp": "qwen3_5_text",
}

_QWEN35 = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
)


def tiny_model_dir(arch: str, path: Path) -> Path:
    """A tiny HF checkpoint (model + the character tokenizer) of `arch` at `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.common.tiny import build_tiny_model, build_tokenizer, save_pretrained_pair

    if (path / "config.json").exists():
        return path
    tok = build_tokenizer()
    if arch in ("qwen3", "qwen3_moe"):
        model = build_tiny_model(arch, tok, seed=0)
    else:
        kw = dict(_QWEN35, vocab_size=len(tok))
        if arch == "qwen3_5_moe_text":
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        cfg = AutoConfig.for_model(arch, **kw)
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return save_pretrained_pair(model, tok, path)
