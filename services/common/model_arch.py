"""Architecture facts of a causal LM, from a Hugging Face config: what `meshrl plan` needs to
check a parallel layout and estimate memory, and what the megatron engine needs to build a
megatron-core model. No torch, no transformers: plain dicts in, a frozen dataclass out.

    arch = load_arch("Qwen/Qwen3-30B-A3B")          # the table below (no model hub here)
    arch = load_arch("/ckpt/qwen3-8b")              # a local directory with config.json
    arch.param_counts()                             # {"embedding": ..., "dense": ..., "expert": ...}

`KNOWN_CONFIGS` holds the text-model fields of the recipes' models. Qwen3 entries match the
published config.json files; Qwen3.5 entries follow published training scripts (slime's
`scripts/models/qwen3.5-*.sh`) where those exist and are marked `verified: False` where a field
is from memory. A local `model.path` always wins over the table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError

QWEN3_VOCAB = 151936
QWEN35_VOCAB = 248320

KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-8B": dict(
        model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=QWEN3_VOCAB,
        tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
    ),
    "Qwen/Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=QWEN3_VOCAB, tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960,
    ),
    "Qwen/Qwen3-235B-A22B": dict(
        model_type="qwen3_moe", hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, intermediate_size=12288, moe_intermediate_size=1536,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=QWEN3_VOCAB, tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960,
    ),
    # Qwen3.5: hybrid layers, 3 gated delta-net (linear attention) layers per full-attention layer.
    "Qwen/Qwen3.5-27B": dict(
        model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, intermediate_size=17408, vocab_size=QWEN35_VOCAB,
        tie_word_embeddings=False, rope_theta=10_000_000.0, rms_norm_eps=1e-6, full_attention_interval=4,
        attn_output_gate=True, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144, verified=False,
    ),
    "Qwen/Qwen3.5-122B-A10B": dict(
        model_type="qwen3_5_moe_text", hidden_size=3072, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=2, head_dim=256, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
        num_experts=256, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=QWEN35_VOCAB,
        tie_word_embeddings=False, rope_theta=10_000_000.0, rms_norm_eps=1e-6, full_attention_interval=4,
        attn_output_gate=True, linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144, verified=False,
    ),
}

# Model types whose attention is partly gated delta-net (linear attention): no THD packing.
LINEAR_ATTENTION_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
MOE_TYPES = {"qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen2_moe"}


@dataclass(frozen=True)
class ModelArch:
    """The facts of one decoder-only model that layouts and memory depend on."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    """Per layer: True where the MLP is a mixture of experts."""
    linear_attention_layers: tuple[bool, ...] = ()
    """Per layer: True where the token mixer is gated delta-net (linear attention)."""
    attention_bias: bool = False
    mlp_bias: bool = False
    """Biases on the MLP projections (Llama's `mlp_bias`)."""
    qk_norm: bool = True
    attn_output_gate: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    max_position_embeddings: int = 32768
    rope_type: str = "default"
    """`rope_scaling` / `rope_parameters` type (llama3, yarn, linear, ...); "default": plain RoPE."""
    sliding_window: bool = False
    """Some layers use sliding-window attention (`layer_types` / `use_sliding_window`)."""
    verified: bool = True
    """False where some field comes from memory rather than the published config.json."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_linear_attention(self) -> bool:
        return any(self.linear_attention_layers)

    @property
    def num_linear_attention_layers(self) -> int:
        return sum(self.linear_attention_layers)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """Build from a config.json dict (top level or a multimodal `text_config`)."""
        if "text_config" in cfg and "hidden_size" not in cfg:
            cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
        try:
            model_type = str(cfg["model_type"])
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
        except KeyError as exc:
            raise ConfigError(f"model config lacks {exc.args[0]!r}; is this a decoder-only causal LM config.json?") from None
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        sparse_step = int(cfg.get("decoder_sparse_step") or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(
            experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0 for i in range(layers)
        )
        layer_types = cfg.get("layer_types")
        if layer_types:
            linear = tuple(t == "linear_attention" for t in layer_types)
        elif model_type in LINEAR_ATTENTION_TYPES:
            interval = int(cfg.get("full_attention_interval") or 4)
            linear = tuple((i + 1) % interval != 0 for i in range(layers))
        else:
            linear = tuple(False for _ in range(layers))
        rope = cfg.get("rope_theta")
        if rope is None and isinstance(cfg.get("rope_parameters"), dict):
            rope = cfg["rope_parameters"].get("rope_theta")
        sliding = any(t == "sliding_attention" for t in layer_types or ()) or bool(
            not layer_types and cfg.get("use_sliding_window") and cfg.get("sliding_window")
            and int(cfg.get("max_window_layers") or 0) < layers
        )
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_type = str(scaling.get("rope_type") or scaling.get("type") or "default") if isinstance(scaling, dict) else "default"
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_theta=float(rope if rope is not None else 10000.0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            moe_layers=moe_layers,
            linear_attention_layers=linear,
            # Qwen2 (and Qwen2-MoE) always have q/k/v biases; their config.json has no such key.
            attention_bias=bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type not in ("qwen2", "qwen2_moe", "llama"),
            attn_output_gate=bool(cfg.get("attn_output_gate", model_type in LINEAR_ATTENTION_TYPES)),
            linear_num_key_heads=int(cfg.get("linear_num_key_heads") or 0),
            linear_num_value_heads=int(cfg.get("linear_num_value_heads") or 0),
            linear_key_head_dim=int(cfg.get("linear_key_head_dim") or 0),
            linear_value_head_dim=int(cfg.get("linear_value_head_dim") or 0),
            linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim") or 0),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768),
            rope_type=rope_type,
            sliding_window=sliding,
            verified=bool(cfg.get("verified", True)),
        )

    # ---- parameter counts ------------------------------------------------------------------

    def attention_params(self, linear: bool) -> int:
        h = self.hidden_size
        if linear:
            nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
            dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
            conv_dim = 2 * nk * dk + nv * dv
            return (
                h * (2 * nk * dk + 2 * nv * dv)  # in_proj_qkvz
                + h * 2 * nv  # in_proj_ba
                + conv_dim * self.linear_conv_kernel_dim  # depthwise conv
                + 2 * nv + dv  # dt_bias, A_log, norm
                + nv * dv * h  # out_proj
            )
        q_out = self.num_attention_heads * self.head_dim * (2 if self.attn_output_gate else 1)
        kv_out = 2 * self.num_key_value_heads * self.head_dim
        n = h * (q_out + kv_out) + self.num_attention_heads * self.head_dim * h
        if self.attention_bias:
            n += q_out + kv_out
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def param_counts(self) -> dict[str, int]:
        """Parameters by kind: `embedding` (input embedding), `output` (LM head, 0 if tied),
        `dense` (attention, norms, dense MLPs, routers, shared experts), `expert` (routed experts)."""
        h = self.hidden_size
        dense = h  # final norm
        expert = 0
        for i in range(self.num_layers):
            linear = bool(self.linear_attention_layers and self.linear_attention_layers[i])
            dense += self.attention_params(linear) + 2 * h
            if self.moe_layers and self.moe_layers[i]:
                dense += self.num_experts * h
                expert += self.num_experts * 3 * h * self.moe_intermediate_size
                if self.shared_expert_intermediate_size:
                    dense += 3 * h * self.shared_expert_intermediate_size + h
            else:
                dense += 3 * h * self.intermediate_size
        emb = self.vocab_size * h
        return {"embedding": emb, "output": 0 if self.tie_word_embeddings else emb, "dense": dense, "expert": expert}

    def layer_params(self, i: int) -> tuple[int, int]:
        """(dense, expert) parameters of decoder layer i."""
        h = self.hidden_size
        linear = bool(self.linear_attention_layers and self.linear_attention_layers[i])
        dense = self.attention_params(linear) + 2 * h
        expert = 0
        if self.moe_layers and self.moe_layers[i]:
            dense += self.num_experts * h
            expert = self.num_experts * 3 * h * self.moe_intermediate_size
            if self.shared_expert_intermediate_size:
                dense += 3 * h * self.shared_expert_intermediate_size + h
        else:
            dense += 3 * h * self.intermediate_size
        return dense, expert

    @property
    def total_params(self) -> int:
        return sum(self.param_counts().values())


def read_hf_config(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "config.json"
    try:
        return dict(json.loads(p.read_text()))
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc}; set actor_rollout_ref.model.path to a HF checkpoint directory") from None


def vocab_size_of(path: str | Path | None) -> int | None:
    """The vocabulary size in a local checkpoint's config.json (None when there is none): every
    token id the policy samples is below it."""
    if path is None or not Path(path, "config.json").is_file():
        return None
    cfg = read_hf_config(path)
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(vocab) if vocab else None


def load_arch(name_or_path: str) -> ModelArch:
    """A local checkpoint directory (config.json) or a name from `KNOWN_CONFIGS`."""
    if Path(name_or_path, "config.json").is_file():
        return ModelArch.from_hf_config(read_hf_config(name_or_path))
    key = name_or_path.rstrip("/")
    matches = [k for k in KNOWN_CONFIGS if k == key or k.split("/")[-1] == key.split("/")[-1]]
    if not matches:
        raise ConfigError(
            f"actor_rollout_ref.model.path={name_or_path!r} is neither a directory with config.json nor a known "
            f"model ({', '.join(sorted(KNOWN_CONFIGS))}); point it at a local HF checkpoint"
        )
    return ModelArch.from_hf_config(KNOWN_CONFIGS[matches[0]])
