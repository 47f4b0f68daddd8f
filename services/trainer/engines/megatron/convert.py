"""Hugging Face <-> megatron-core weight mapping for Qwen3 dense and Qwen3-MoE (pure torch).

Every megatron parameter name resolves to a `ParamRule`: which HF tensors it comes from and how
they are laid out and sharded. `shard_from_hf` builds one rank's tensor from full HF tensors;
`merge_to_hf` rebuilds the full HF tensors from the shards of all ranks of the relevant group
(TP for dense weights, expert-TP for expert weights). The round trip is exact (no arithmetic).

megatron layouts (local and Transformer Engine specs):

    linear_qkv.weight   [groups/TP * (heads_per_group + 2) * head_dim, hidden]
                        per query group: its q heads, then k, then v (groups split over TP)
    linear_fc1.weight   [2 * ffn/TP, hidden] = cat(gate[rank slice], up[rank slice])
    linear_proj / linear_fc2   split over TP along dim 1
    word_embeddings / output_layer   split over TP along the (padded) vocab dim 0
    experts             local expert j on EP rank r is global expert r * (E / EP) + j, with
                        fc1/fc2 split over expert-TP like the dense MLP

HF names are the checkpoint names (what `save_pretrained` writes and vLLM's `load_weights`
reads): per-expert `mlp.experts.{e}.gate_proj.weight`, not transformers' fused in-memory
`gate_up_proj`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from services.common.errors import ConfigError
from services.common.model_arch import ModelArch

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama")

RuleKind = Literal["copy", "vocab", "split", "qkv", "gate_up"]


@dataclass(frozen=True)
class ParallelCoords:
    """Where one rank sits, for sharding: tensor, expert, expert-tensor and pipeline parallel."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups of each parallel dimension (megatron's parallel_state)."""

    tp: dist.ProcessGroup
    ep: dist.ProcessGroup
    etp: dist.ProcessGroup
    pp: dist.ProcessGroup


@dataclass(frozen=True)
class ParamRule:
    """How one megatron parameter relates to HF tensors."""

    kind: RuleKind
    hf_names: tuple[str, ...]
    dim: int = 0
    """Split dimension for `split` / `vocab`."""
    expert: bool = False
    """Sharded over expert-TP (and placed by EP) instead of TP."""


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """megatron pads the vocabulary so each TP rank holds an equal, aligned slice."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def check_supported(arch: ModelArch) -> None:
    if arch.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"the megatron engine's own HF<->megatron mapping covers {', '.join(SUPPORTED_MODEL_TYPES)}, not "
            f"{arch.model_type!r}; use actor_rollout_ref.actor.strategy=fsdp for this model"
        )
    if arch.has_linear_attention or arch.shared_expert_intermediate_size or arch.attn_output_gate:
        raise ConfigError(
            f"{arch.model_type}: gated delta-net / shared experts / gated attention are not mapped by the megatron "
            "engine; use actor_rollout_ref.actor.strategy=fsdp"
        )
    if arch.mlp_bias or (arch.attention_bias and arch.model_type != "qwen2"):
        # megatron's add_qkv_bias covers q/k/v only; attention_bias of Qwen3 / Llama also biases o_proj.
        raise ConfigError(
            f"{arch.model_type}: o_proj / MLP biases (attention_bias / mlp_bias) are not mapped by the megatron "
            "engine; use actor_rollout_ref.actor.strategy=fsdp"
        )
    if arch.sliding_window:
        raise ConfigError(
            f"{arch.model_type}: sliding-window attention layers are not mapped by the megatron engine (they would "
            "attend to the whole prefix); use actor_rollout_ref.actor.strategy=fsdp"
        )
    if arch.rope_type != "default":
        raise ConfigError(
            f"{arch.model_type}: rope scaling {arch.rope_type!r} is not mapped by the megatron engine (it would run "
            "plain RoPE); use actor_rollout_ref.actor.strategy=fsdp"
        )


_LAYER = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")


def rule_for(
    name: str, arch: ModelArch, global_layer: Callable[[int], int], coords: ParallelCoords
) -> ParamRule:
    """The rule of megatron parameter `name` (as in `model.named_parameters()`).
    `global_layer(local_index)` maps a stage-local layer index to the model's layer index."""
    name = re.sub(r"^(module\.)+", "", name)
    if name == "embedding.word_embeddings.weight":
        return ParamRule("vocab", ("model.embed_tokens.weight",))
    if name == "output_layer.weight":
        return ParamRule("vocab", ("lm_head.weight",))
    if name == "decoder.final_layernorm.weight":
        return ParamRule("copy", ("model.norm.weight",))
    m = _LAYER.match(name)
    if m is None:
        raise ConfigError(f"no HF mapping for megatron parameter {name!r}")
    g = global_layer(int(m.group(1)))
    rest = m.group(2)
    hf = f"model.layers.{g}."
    attn = hf + "self_attn."
    table: dict[str, ParamRule] = {
        "input_layernorm.weight": ParamRule("copy", (hf + "input_layernorm.weight",)),
        "self_attention.linear_qkv.layer_norm_weight": ParamRule("copy", (hf + "input_layernorm.weight",)),
        "self_attention.linear_qkv.weight": ParamRule(
            "qkv", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")
        ),
        "self_attention.linear_qkv.bias": ParamRule("qkv", (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias")),
        "self_attention.q_layernorm.weight": ParamRule("copy", (attn + "q_norm.weight",)),
        "self_attention.k_layernorm.weight": ParamRule("copy", (attn + "k_norm.weight",)),
        "self_attention.linear_proj.weight": ParamRule("split", (attn + "o_proj.weight",), dim=1),
        "pre_mlp_layernorm.weight": ParamRule("copy", (hf + "post_attention_layernorm.weight",)),
        "mlp.linear_fc1.layer_norm_weight": ParamRule("copy", (hf + "post_attention_layernorm.weight",)),
        "mlp.linear_fc1.weight": ParamRule("gate_up", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")),
        "mlp.linear_fc2.weight": ParamRule("split", (hf + "mlp.down_proj.weight",), dim=1),
        "mlp.router.weight": ParamRule("copy", (hf + "mlp.gate.weight",)),
    }
    if rest in table:
        return table[rest]
    em = _LOCAL_EXPERT.match(rest)
    gm = _GROUPED_EXPERT.match(rest)
    if em or gm:
        local, which = (int(em.group(1)), em.group(2)) if em else (int(gm.group(2)), gm.group(1))  # type: ignore[union-attr]
        per_rank = arch.num_experts // coords.ep_size
        e = coords.ep_rank * per_rank + local
        ex = f"{hf}mlp.experts.{e}."
        if which == "linear_fc1":
            return ParamRule("gate_up", (ex + "gate_proj.weight", ex + "up_proj.weight"), expert=True)
        return ParamRule("split", (ex + "down_proj.weight",), dim=1, expert=True)
    raise ConfigError(f"no HF mapping for megatron parameter {name!r}")


def _rank_size(rule: ParamRule, coords: ParallelCoords) -> tuple[int, int]:
    return (coords.etp_rank, coords.etp_size) if rule.expert else (coords.tp_rank, coords.tp_size)


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ConfigError(f"dimension {dim} of a {tuple(t.shape)} tensor does not divide over {size} ranks")
    return t.chunk(size, dim=dim)[rank]


def _qkv_groups(arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[groups, heads_per_group + 2, head_dim, *rest] in megatron's per-group order."""
    ng, hd = arch.num_key_value_heads, arch.head_dim
    per = arch.num_attention_heads // ng
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(ng, per, hd, *rest), k.reshape(ng, 1, hd, *rest), v.reshape(ng, 1, hd, *rest)], dim=1
    )


def shard_from_hf(
    rule: ParamRule, get_hf: Callable[[str], torch.Tensor], arch: ModelArch, coords: ParallelCoords, padded_vocab: int
) -> torch.Tensor:
    """This rank's tensor for `rule`, built from full HF tensors."""
    rank, size = _rank_size(rule, coords)
    if rule.kind == "copy":
        return get_hf(rule.hf_names[0]).clone()
    if rule.kind == "vocab":
        full = get_hf(rule.hf_names[0])
        if padded_vocab > full.shape[0]:
            pad = full.new_zeros((padded_vocab - full.shape[0], *full.shape[1:]))
            full = torch.cat([full, pad], dim=0)
        return _chunk(full, 0, rank, size).clone()
    if rule.kind == "split":
        return _chunk(get_hf(rule.hf_names[0]), rule.dim, rank, size).clone()
    if rule.kind == "gate_up":
        gate, up = (get_hf(n) for n in rule.hf_names)
        return torch.cat([_chunk(gate, 0, rank, size), _chunk(up, 0, rank, size)], dim=0).clone()
    if rule.kind == "qkv":
        q, k, v = (get_hf(n) for n in rule.hf_names)
        grouped = _qkv_groups(arch, q, k, v)
        if grouped.shape[0] % size:
            raise ConfigError(
                f"num_key_value_heads={arch.num_key_value_heads} does not divide over tensor_model_parallel_size={size}"
            )
        mine = grouped.chunk(size, dim=0)[rank]
        return mine.reshape(-1, *q.shape[1:]).clone()
    raise AssertionError(rule.kind)


def merge_to_hf(
    rule: ParamRule, shards: list[torch.Tensor], arch: ModelArch, vocab_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Full HF tensors from the shards of every rank of the rule's group, in rank order."""
    if rule.kind == "copy":
        return {rule.hf_names[0]: shards[0]}
    if rule.kind == "vocab":
        full = torch.cat(shards, dim=0)
        return {rule.hf_names[0]: full[: vocab_size or arch.vocab_size]}
    if rule.kind == "split":
        return {rule.hf_names[0]: torch.cat(shards, dim=rule.dim)}
    if rule.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return {
            rule.hf_names[0]: torch.cat([h[0] for h in halves], dim=0),
            rule.hf_names[1]: torch.cat([h[1] for h in halves], dim=0),
        }
    if rule.kind == "qkv":
        q, k, v = split_qkv(torch.cat(shards, dim=0), arch)
        assert q.shape[0] == arch.num_attention_heads * arch.head_dim, (q.shape, arch.num_attention_heads)
        return dict(zip(rule.hf_names, (q.contiguous(), k.contiguous(), v.contiguous()), strict=True))
    raise AssertionError(rule.kind)


def split_qkv(t: torch.Tensor, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k and v rows of a `linear_qkv` tensor holding whole query groups (megatron's
    per-group order: each group's q heads, then its k, then its v), in group order."""
    hd = arch.head_dim
    per = arch.num_attention_heads // arch.num_key_value_heads
    rest = t.shape[1:]
    grouped = t.reshape(-1, per + 2, hd, *rest)
    groups = int(grouped.shape[0])
    return (grouped[:, :per].reshape(groups * per * hd, *rest), grouped[:, per].reshape(groups * hd, *rest),
            grouped[:, per + 1].reshape(groups * hd, *rest))


def local_mcore_names(arch: ModelArch, layers: range, ep_size: int = 1, first: bool = True, last: bool = True) -> list[str]:
    """megatron parameter names (local spec, SequentialMLP experts) of a stage holding `layers`
    (global indices; named stage-locally from 0). For tests and docs."""
    names = ["embedding.word_embeddings.weight"] if first else []
    for local, g in enumerate(layers):
        p = f"decoder.layers.{local}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        if arch.attention_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if arch.qk_norm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names += [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight"]
        if arch.moe_layers and arch.moe_layers[g]:
            names.append(p + "mlp.router.weight")
            for j in range(arch.num_experts // ep_size):
                names += [f"{p}mlp.experts.local_experts.{j}.linear_fc1.weight", f"{p}mlp.experts.local_experts.{j}.linear_fc2.weight"]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    if last:
        names.append("decoder.final_layernorm.weight")
        if not arch.tie_word_embeddings:
            names.append("output_layer.weight")
    return names


def hf_param_names(arch: ModelArch) -> list[str]:
    """Every HF checkpoint tensor name of the model, in checkpoint order."""
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names.append(p + "input_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj"):
            names.append(f"{p}self_attn.{proj}.weight")
            if arch.attention_bias:
                names.append(f"{p}self_attn.{proj}.bias")
        names.append(p + "self_attn.o_proj.weight")
        if arch.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names.append(p + "post_attention_layernorm.weight")
        if arch.moe_layers and arch.moe_layers[i]:
            names.append(p + "mlp.gate.weight")
            for e in range(arch.num_experts):
                names += [f"{p}mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")]
        else:
            names += [f"{p}mlp.{w}_proj.weight" for w in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def fused_to_checkpoint_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory MoE layout (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]) -> per-expert checkpoint names. Other names pass through."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"] = gate
                out[f"{base}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


_EXPERT_NAME = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


def checkpoint_to_fused_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `fused_to_checkpoint_names`: per-expert checkpoint names -> transformers'
    in-memory `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] (what
    `model.load_state_dict` of a transformers 5 MoE wants). Other names pass through."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        m = _EXPERT_NAME.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for base, by_expert in experts.items():
        ids = sorted(by_expert)
        assert ids == list(range(len(ids))), f"{base}: experts {ids} are not 0..E-1"
        out[base + "gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["gate"], by_expert[e]["up"]]) for e in ids])
        out[base + "down_proj"] = torch.stack([by_expert[e]["down"] for e in ids])
    return out

