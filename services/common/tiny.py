"""Tiny models and a tokenizer that meshrl builds itself (no model hub): for the built-in example,
tests and benchmarks.

    tok = build_tokenizer()                       # character-level, saved/loaded like any HF tokenizer
    model = build_tiny_model("qwen3", tok, seed=0)  # a real transformers Qwen3ForCausalLM
    save_pretrained_pair(model, tok, path)        # AutoModelForCausalLM/AutoTokenizer.from_pretrained(path)

The vocabulary is fixed (printable ASCII plus special tokens), so every process that builds the
tokenizer gets the same ids.
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Any

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL = [PAD, BOS, EOS, UNK, "<|im_start|>", "<|im_end|>"]
CHARS = [c for c in string.printable if c not in "\x0b\x0c\r"]

# A ChatML-style template so chat-form prompts work like they do with Qwen tokenizers.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Tool calling, Qwen3 / hermes style: tool responses go back inside a user turn. The tools
# themselves are not rendered (a tiny model learns its one tool from its warm start).
TOOL_CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build_tokenizer(tools: bool = False) -> Any:
    """A character-level PreTrainedTokenizerFast (vocab = specials + printable ASCII). With
    `tools`: the hermes tool-call markers as single (non-special) tokens after them, `<|im_end|>`
    as the end-of-sequence token (an assistant turn ends with it, as in Qwen's chat models) and
    a chat template that renders `tool` messages like Qwen3's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token="<|im_end|>" if tools else EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=SPECIAL[4:],
        padding_side="left",
        chat_template=TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE,
    )
    if tools:
        tok.add_tokens(TOOL_TOKENS)
    return tok


TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # ~0.8M parameters: the built-in example's policy.
    "qwen3": dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=384, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
    ),
    # ~25M parameters: enough work per token for a GPU benchmark (scripts/gpu/bench_e2e.sh).
    "qwen3_small": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        intermediate_size=1536, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
    ),
    "qwen3_moe": dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False, decoder_sparse_step=1, norm_topk_prob=True,
    ),
}

# Sizes that are not a transformers model_type of their own.
MODEL_TYPE: dict[str, str] = {"qwen3_small": "qwen3"}


def tiny_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    """A transformers config for a tiny model of architecture `arch` (qwen3, qwen3_small, qwen3_moe)."""
    from transformers import AutoConfig

    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; use one of {sorted(TINY_CONFIGS)}")
    kwargs = {**TINY_CONFIGS[arch], **overrides, "vocab_size": vocab_size}
    return AutoConfig.for_model(MODEL_TYPE.get(arch, arch), **kwargs)


def build_tiny_model(arch: str = "qwen3", tokenizer: Any = None, *, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised tiny causal LM whose special-token ids match `tokenizer`."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = tokenizer or build_tokenizer()
    cfg = tiny_config(arch, len(tok), **overrides)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    return model


def save_pretrained_pair(model: Any, tokenizer: Any, path: str | os.PathLike[str]) -> Path:
    """Write a directory that AutoModelForCausalLM / AutoTokenizer load."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
