"""HF <-> megatron weight mapping without megatron-core: shard every HF tensor for every
(TP, EP, ETP, PP) coordinate, merge back, and demand bit-exact equality."""

from __future__ import annotations

import itertools

import pytest
import torch

from services.common.errors import ConfigError
from services.common.model_arch import ModelArch
from services.trainer.engines.megatron.convert import (
    ParallelCoords,
    checkpoint_to_fused_names,
    fused_to_checkpoint_names,
    hf_param_names,
    local_mcore_names,
    merge_to_hf,
    padded_vocab_size,
    rule_for,
    shard_from_hf,
)

DENSE = dict(
    model_type="qwen3", vocab_size=103, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, intermediate_size=48, tie_word_embeddings=False,
)
MOE = dict(
    model_type="qwen3_moe", vocab_size=103, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
    num_experts_per_tok=2, tie_word_embeddings=False, mlp_only_layers=[1],
)


def hf_state(arch: ModelArch, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, hd = arch.hidden_size, arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for name in hf_param_names(arch):
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            shapes[name] = (arch.vocab_size, h)
        elif name.endswith("q_proj.bias"):
            shapes[name] = (arch.num_attention_heads * hd,)
        elif name.endswith(("k_proj.bias", "v_proj.bias")):
            shapes[name] = (arch.num_key_value_heads * hd,)
        elif name.endswith("q_proj.weight"):
            shapes[name] = (arch.num_attention_heads * hd, h)
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            shapes[name] = (arch.num_key_value_heads * hd, h)
        elif name.endswith("o_proj.weight"):
            shapes[name] = (h, arch.num_attention_heads * hd)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            shapes[name] = (hd,)
        elif name.endswith("mlp.gate.weight"):
            shapes[name] = (arch.num_experts, h)
        elif ".experts." in name:
            i = arch.moe_intermediate_size
            shapes[name] = (h, i) if name.endswith("down_proj.weight") else (i, h)
        elif name.endswith("down_proj.weight"):
            shapes[name] = (h, arch.intermediate_size)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            shapes[name] = (arch.intermediate_size, h)
        else:
            shapes[name] = (h,)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def roundtrip(arch: ModelArch, tp: int, ep: int, etp: int, pp: int) -> dict[str, torch.Tensor]:
    hf = hf_state(arch)
    padded = padded_vocab_size(arch.vocab_size, tp)
    per_stage = arch.num_layers // pp
    shards: dict[tuple, list[tuple[ParallelCoords, torch.Tensor]]] = {}
    rules = {}
    for stage in range(pp):
        layers = range(stage * per_stage, (stage + 1) * per_stage)
        for tp_rank, ep_rank, etp_rank in itertools.product(range(tp), range(ep), range(etp)):
            c = ParallelCoords(tp_rank, tp, ep_rank, ep, etp_rank, etp)
            for name in local_mcore_names(arch, layers, ep, first=stage == 0, last=stage == pp - 1):
                rule = rule_for(name, arch, lambda i, layers=layers: layers[i], c)
                t = shard_from_hf(rule, hf.__getitem__, arch, c, padded)
                key = (stage, name, ep_rank if rule.expert else 0)
                rules[key] = rule
                rank = etp_rank if rule.expert else tp_rank
                group = shards.setdefault(key, [])
                # One shard per rank of the rule's group (others are replicas: must be equal).
                existing = [s for cc, s in group if (cc.etp_rank if rule.expert else cc.tp_rank) == rank]
                if existing:
                    assert torch.equal(existing[0], t)
                else:
                    group.append((c, t))
    merged: dict[str, torch.Tensor] = {}
    for key, group in shards.items():
        rule = rules[key]
        group.sort(key=lambda x: x[0].etp_rank if rule.expert else x[0].tp_rank)
        for name, t in merge_to_hf(rule, [s for _, s in group], arch).items():
            if name in merged:
                assert torch.equal(merged[name], t), name
            merged[name] = t
    assert sorted(merged) == sorted(hf)
    for name in hf:
        assert torch.equal(merged[name], hf[name]), name
    return merged


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2), (4, 4)])
def test_dense_roundtrip_exact(tp: int, pp: int) -> None:
    arch = ModelArch.from_hf_config({**DENSE, "num_key_value_heads": 4})
    roundtrip(arch, tp=tp, ep=1, etp=tp, pp=pp)


@pytest.mark.parametrize("tp,ep,etp", [(1, 1, 1), (2, 2, 1), (2, 2, 2), (1, 4, 1), (2, 1, 2)])
def test_moe_roundtrip_exact(tp: int, ep: int, etp: int) -> None:
    arch = ModelArch.from_hf_config(MOE)
    assert arch.moe_layers == (True, False)  # mlp_only_layers=[1]
    roundtrip(arch, tp=tp, ep=ep, etp=etp, pp=1)


def test_qkv_layout_is_megatron_per_group() -> None:
    """Group g holds its q heads, then k_g, then v_g; TP rank r holds groups r*G/TP..."""
    arch = ModelArch.from_hf_config(DENSE)  # 4 heads, 2 groups, head_dim 8
    hd, h = 8, 32
    q = torch.arange(4 * hd, dtype=torch.float32)[:, None].expand(4 * hd, h) + 0
    k = 1000 + torch.arange(2 * hd, dtype=torch.float32)[:, None].expand(2 * hd, h)
    v = 2000 + torch.arange(2 * hd, dtype=torch.float32)[:, None].expand(2 * hd, h)
    hf = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
          "model.layers.0.self_attn.v_proj.weight": v}
    rule = rule_for("decoder.layers.0.self_attention.linear_qkv.weight", arch, lambda i: i, ParallelCoords())
    full = shard_from_hf(rule, hf.__getitem__, arch, ParallelCoords(), 128)[:, 0]
    expected = torch.cat([q[: 2 * hd, 0], k[:hd, 0], v[:hd, 0], q[2 * hd :, 0], k[hd:, 0], v[hd:, 0]])
    assert torch.equal(full, expected)
    rank1 = shard_from_hf(rule, hf.__getitem__, arch, ParallelCoords(tp_rank=1, tp_size=2), 128)[:, 0]
    assert torch.equal(rank1, expected[expected.numel() // 2 :])


def test_gate_up_interleaves_per_rank_and_vocab_pads() -> None:
    arch = ModelArch.from_hf_config(DENSE)
    gate = torch.arange(48.0)[:, None].expand(48, 32)
    up = -torch.arange(48.0)[:, None].expand(48, 32)
    hf = {"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up,
          "model.embed_tokens.weight": torch.randn(103, 32)}
    rule = rule_for("decoder.layers.0.mlp.linear_fc1.weight", arch, lambda i: i, ParallelCoords())
    r1 = shard_from_hf(rule, hf.__getitem__, arch, ParallelCoords(tp_rank=1, tp_size=2), 128)
    assert torch.equal(r1[:24, 0], torch.arange(24.0, 48.0)) and torch.equal(r1[24:, 0], -torch.arange(24.0, 48.0))
    assert padded_vocab_size(103, 2) == 256 and padded_vocab_size(151936, 1) == 151936
    emb = rule_for("embedding.word_embeddings.weight", arch, lambda i: i, ParallelCoords())
    last = shard_from_hf(emb, hf.__getitem__, arch, ParallelCoords(tp_rank=1, tp_size=2), 256)
    assert last.shape == (128, 32) and torch.count_nonzero(last[103 - 128 :]) == 0


def test_expert_placement_follows_ep_rank() -> None:
    arch = ModelArch.from_hf_config(MOE)
    rule = rule_for("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", arch, lambda i: i,
                    ParallelCoords(ep_rank=1, ep_size=2))
    assert rule.hf_names == ("model.layers.0.mlp.experts.3.down_proj.weight",) and rule.expert
    grouped = rule_for("decoder.layers.0.mlp.experts.linear_fc1.weight1", arch, lambda i: i, ParallelCoords(ep_rank=1, ep_size=2))
    assert grouped.hf_names[0] == "model.layers.0.mlp.experts.3.gate_proj.weight"


def test_unknown_parameter_and_unsupported_model_are_named() -> None:
    arch = ModelArch.from_hf_config(DENSE)
    with pytest.raises(ConfigError, match=r"decoder\.layers\.0\.self_attention\.weird"):
        rule_for("decoder.layers.0.self_attention.weird", arch, lambda i: i, ParallelCoords())
    from services.trainer.engines.megatron.convert import check_supported

    with pytest.raises(ConfigError, match="strategy=fsdp"):
        check_supported(ModelArch.from_hf_config({**DENSE, "model_type": "qwen3_5_text"}))


def test_fused_transformers_moe_layout_maps_to_checkpoint_names() -> None:
    from services.common.tiny import build_tiny_model, build_tokenizer

    model = build_tiny_model("qwen3_moe", build_tokenizer(), seed=0)
    state = fused_to_checkpoint_names(model.state_dict())
    arch = ModelArch.from_hf_config(model.config.to_dict())
    expected = set(hf_param_names(arch))
    assert set(state) == expected
    fused = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(state["model.layers.0.mlp.experts.2.up_proj.weight"], fused[2].chunk(2, dim=0)[1])
    back = checkpoint_to_fused_names(state)
    original = model.state_dict()
    assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original)


def owned_everywhere(arch: ModelArch, tp: int, ep: int, etp: int, pp: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Every simulated rank's `owned_slices` (megatron/shards.py) into one ShardAssembler: the
    weight sync from every rank, without the wire. Dense tensors vary with the TP rank only, so
    ranks that differ in EP / ETP coordinates hold dense replicas; expert tensors vary with the
    EP / ETP ranks, so ranks that differ in TP hold expert replicas. Returns the rebuilt tensors
    and the bytes each rank sent."""
    from services.trainer.engines.megatron.shards import Replicas, owned_slices
    from services.weights.shards import ShardAssembler

    hf = hf_state(arch)
    padded = padded_vocab_size(arch.vocab_size, tp)
    per_stage = arch.num_layers // pp
    asm = ShardAssembler("cpu")
    rebuilt: dict[str, torch.Tensor] = {}
    sent: list[int] = []
    for stage in range(pp):
        layers = range(stage * per_stage, (stage + 1) * per_stage)
        for tp_rank, ep_rank, etp_rank in itertools.product(range(tp), range(ep), range(etp)):
            c = ParallelCoords(tp_rank, tp, ep_rank, ep, etp_rank, etp, stage, pp)
            params = []
            for name in local_mcore_names(arch, layers, ep, first=stage == 0, last=stage == pp - 1):
                rule = rule_for(name, arch, lambda i, layers=layers: layers[i], c)
                params.append((name, shard_from_hf(rule, hf.__getitem__, arch, c, padded), rule))
            replicas = Replicas(dense=int((ep_rank, etp_rank) != (0, 0)), expert=tp_rank)
            n = 0
            held = {t.untyped_storage().data_ptr() for _, t, _ in params}
            for wire, t in owned_slices(params, arch, c, replicas):
                assert t.is_contiguous(), wire
                assert t.untyped_storage().data_ptr() not in held, f"{wire} is a view of the parameter, not a copy"
                n += t.numel() * t.element_size()
                rebuilt.update(asm.add(wire, t))
            sent.append(n)
    assert asm.finish() == sorted(rebuilt)
    return rebuilt, sent


@pytest.mark.parametrize(
    "model,tp,ep,etp,pp",
    [("dense", 1, 1, 1, 1), ("dense", 2, 1, 1, 1), ("dense", 4, 1, 1, 2), ("gqa", 2, 1, 1, 2), ("qwen2", 2, 1, 1, 1),
     ("moe", 2, 2, 1, 1), ("moe", 2, 2, 2, 1), ("moe", 1, 4, 1, 1), ("moe", 2, 1, 2, 1)],
)
def test_every_rank_sends_its_own_slices_and_they_rebuild_every_hf_tensor_once(
    model: str, tp: int, ep: int, etp: int, pp: int
) -> None:
    """The weight sync from every rank for megatron (param_server.collective_sharded): each rank's
    slices, assembled, give every HF tensor bit-exactly, nothing is sent twice (the assembler
    refuses overlaps), replicas and padding rows send nothing, and the bytes add up to the model's."""
    spec = {"dense": {**DENSE, "num_key_value_heads": 4}, "gqa": DENSE, "moe": MOE,
            "qwen2": {**DENSE, "model_type": "qwen2", "attention_bias": True, "tie_word_embeddings": True}}[model]
    arch = ModelArch.from_hf_config(spec)
    if model == "qwen2":
        assert arch.attention_bias and arch.tie_word_embeddings
    hf = hf_state(arch)
    rebuilt, sent = owned_everywhere(arch, tp, ep, etp, pp)
    assert sorted(rebuilt) == sorted(hf)
    for name, t in hf.items():
        assert torch.equal(rebuilt[name], t), name
    assert sum(sent) == sum(t.numel() * t.element_size() for t in hf.values())
    if tp > 1 and model != "moe":  # every TP rank carries a share (vocab rows past 103 are padding only)
        assert all(n > 0 for n in sent), sent
