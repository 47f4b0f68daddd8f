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
    # Qwen3.5-27B as released: Qwen3_5ForConditionalGeneration (language model + vision tower)
    "qwen3_5_27b_grpo_fsdp": "qwen3_5",
}

_QWEN35 = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
)


_QWEN35_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
)


def tiny_released_qwen35(tok: object, seed: int = 0) -> object:
    """Qwen3.5 in its released layout, tiny: `Qwen3_5ForConditionalGeneration` (model_type
    `qwen3_5`; weights model.language_model.*, model.visual.*, lm_head.*), built from a config
    here (nothing downloaded); its vision tokens are the tokenizer's last ids."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    n = len(tok)  # type: ignore[arg-type]
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,  # type: ignore[attr-defined]
           "pad_token_id": tok.pad_token_id}  # type: ignore[attr-defined]
    cfg = Qwen3_5Config(
        text_config=dict(_QWEN35, vocab_size=n, **ids), vision_config=_QWEN35_VISION, tie_word_embeddings=False,
        image_token_id=n - 1, video_token_id=n - 2, vision_start_token_id=n - 3, vision_end_token_id=n - 4,
    )
    torch.manual_seed(seed)
    return Qwen3_5ForConditionalGeneration(cfg)


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
    elif arch == "qwen3_5":
        model = tiny_released_qwen35(tok)
    else:
        kw = dict(_QWEN35, vocab_size=len(tok))
        if arch == "qwen3_5_moe_text":
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        cfg = AutoConfig.for_model(arch, **kw)
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return save_pretrained_pair(model, tok, path)
