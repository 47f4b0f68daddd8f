"""`meshrl plan`: bytes per dtype, sharding factors and sender counts checked against the engines
(hf_model.master_dtype, dist.build_meshes, fsdp_shards.local_shards, megatron weights / shards)
with the arithmetic written out independently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshrl.plan import make_plan

H, V = 4096, 151936


def qwen3_params(h: int, layers: int, heads: int, kv: int, hd: int, inter: int, vocab: int, tied: bool) -> int:
    """Dense Qwen3 from its HF config fields: q/k/v/o, q/k norms, SwiGLU MLP, 2 norms per layer,
    the final norm, the embedding and (untied) the LM head."""
    layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd + 3 * h * inter + 2 * h
    return layers * layer + h + vocab * h * (1 if tied else 2)


QWEN3_30B = 48 * (2048 * 32 * 128 * 2 + 2 * 2048 * 4 * 128 + 2 * 128 + 128 * 3 * 2048 * 768 + 128 * 2048
                  + 2 * 2048) + 2048 + 2 * V * 2048


def test_fsdp_export_and_memory_use_the_engines_master_dtype() -> None:
    """hf_model.master_dtype: fsdp_config.model_dtype when set, else model.dtype."""
    assert QWEN3_30B == 30_532_122_624
    # model.dtype bf16, fsdp_config.model_dtype not set: the engine holds (and exports) bf16
    plan = make_plan("qwen3_30b_a3b_dapo_fsdp_npu", ["actor_rollout_ref.model.dtype=bfloat16"], link_gbps=200)
    mem = plan["memory"]["trainer_per_rank"]
    assert mem["param_bytes"] == pytest.approx(2 * QWEN3_30B / 16, rel=1e-6)
    assert plan["weight_sync"]["bytes_per_version"] == 2 * QWEN3_30B
    # model.dtype fp32 (default), fsdp_config.model_dtype=bf16 set: bf16 again, on the wire too
    plan = make_plan("qwen3_30b_a3b_dapo_fsdp_npu", ["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"],
                     link_gbps=200)
    assert plan["weight_sync"]["bytes_per_version"] == 2 * QWEN3_30B
    assert plan["memory"]["trainer_per_rank"]["param_bytes"] == pytest.approx(2 * QWEN3_30B / 16, rel=1e-6)


def test_fsdp_adam_state_is_in_the_parameters_dtype() -> None:
    """engines/optim.py: plain torch AdamW, whose exp_avg / exp_avg_sq are zeros_like(param):
    2 + 2 bytes per bf16 parameter, no fp32 master copy."""
    plan = make_plan("qwen3_5_27b_grpo_fsdp", [])  # bf16, 8 ranks
    mem = plan["memory"]["trainer_per_rank"]
    assert mem["optimizer_bytes"] == pytest.approx(4 * plan["model"]["params"] / 8, rel=1e-6)
    plan = make_plan("qwen3_30b_a3b_dapo_fsdp_npu", [])  # fp32, 16 ranks
    assert plan["memory"]["trainer_per_rank"]["optimizer_bytes"] == pytest.approx(8 * QWEN3_30B / 16, rel=1e-6)


def test_megatron_fp32_params_are_4_bytes_and_their_own_master() -> None:
    """model.dtype=float32 on megatron (allowed without optimizer offload): fp32 params 4, fp32 grads
    4, Adam m + v 8 over DP 4 (TP2 x DP4 on 8 ranks, Qwen3-8B)."""
    n = qwen3_params(H, 36, 32, 8, 128, 12288, V, tied=False)
    assert n == 8_190_735_360
    plan = make_plan("qwen3_8b_grpo_mindspeed_npu", ["actor_rollout_ref.model.dtype=float32"])
    mem = plan["memory"]["trainer_per_rank"]
    assert mem["param_bytes"] == pytest.approx(4 * n / 2, rel=1e-6)
    assert mem["grad_bytes"] == pytest.approx(4 * n / 2, rel=1e-6)
    assert mem["optimizer_bytes"] == pytest.approx(8 * n / 2 / 4, rel=1e-6)
    bf16 = make_plan("qwen3_8b_grpo_mindspeed_npu", [])["memory"]["trainer_per_rank"]  # unchanged
    assert bf16["param_bytes"] == pytest.approx(2 * n / 2, rel=1e-6)
    assert bf16["optimizer_bytes"] == pytest.approx(12 * n / 2 / 4, rel=1e-6)


def test_hsdp_replicas_send_nothing() -> None:
    """fsdp_size 8 of 16 ranks: a (2, 8) mesh, parameters (Replicate, Shard(0)); local_shards skips
    the ranks whose replicate coordinate is not 0, so 8 ranks send 1/8 each."""
    sync = make_plan("qwen3_30b_a3b_dapo_fsdp_npu", ["actor_rollout_ref.actor.fsdp_config.fsdp_size=8"],
                     link_gbps=200)["weight_sync"]
    nbytes = 4 * QWEN3_30B  # fp32
    assert sync["every_rank"]["senders"] == 8
    assert sync["every_rank"]["wire_s"] == pytest.approx(nbytes / (8 * 25e9), rel=1e-3)


def test_fsdp_size_above_the_world_is_the_whole_world() -> None:
    """dist.build_meshes: fsdp_size >= world shards over the whole world (as verl does)."""
    plan = make_plan("qwen3_30b_a3b_dapo_fsdp_npu", ["actor_rollout_ref.actor.fsdp_config.fsdp_size=32"])
    assert plan["memory"]["trainer_per_rank"]["params"] == pytest.approx(QWEN3_30B / 16, rel=1e-6)


def test_delta_sync_is_paced_by_the_most_loaded_sender() -> None:
    """235B every rank with EP=1, ETP=1: the rank of a 12-layer stage sends all of its stage's
    experts (one expert-data-parallel replica), 1/8 of the model; its delta goes over its own
    25 GB/s link, slower than the receiving node's 16 links."""
    ov = ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
          "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1", "param_server.collective_sharded=true"]
    plan = make_plan("qwen3_235b_a22b_grpo_megatron_npu", ov, link_gbps=200, changed_fraction=0.02)
    params = plan["model"]["params"]
    expert_layer = 128 * 3 * H * 1536
    dense_layer = H * 64 * 128 * 2 + 2 * H * 4 * 128 + 2 * 128 + 128 * H + 2 * H
    most = 12 * expert_layer + 12 * dense_layer / 4  # a middle stage's rank: experts whole, dense / TP4
    delta = plan["weight_sync"]["delta"]
    assert delta["wire_s"] == pytest.approx(most * 0.02 * 6 / 25e9, rel=1e-2)
    assert delta["device_s"] == pytest.approx(params * 2 / 2**30 * (0.0041 * most / params + 0.0016), rel=1e-2)


def test_tied_embeddings_with_pp_give_the_last_stage_a_copy(tmp_path: Path) -> None:
    """megatron with tied embeddings and PP > 1 allocates output_layer.weight on the last stage
    (megatron/weights.py: 'the last stage's copy of the input embedding')."""
    cfg = dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=V, tie_word_embeddings=True,
               rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    plan = make_plan("qwen3_8b_grpo_mindspeed_npu", [f"actor_rollout_ref.model.path={tmp_path / 'm'}",
                                                    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"])
    h = 2560
    layer = h * 32 * 128 + 2 * h * 8 * 128 + 32 * 128 * h + 2 * 128 + 3 * h * 9728 + 2 * h
    assert plan["model"]["params"] == 36 * layer + h + V * h
    last = 18 * layer + V * h + h  # its layers, the embedding copy, the final norm
    mem = plan["memory"]["trainer_per_rank"]
    assert mem["stage"] == 1 and mem["params"] == pytest.approx(last / 2, rel=1e-9)


def test_rank0_of_a_pure_data_parallel_megatron_trainer_gathers_nothing() -> None:
    """TP = PP = EP = 1 on 8 ranks: rank 0 holds every full tensor (megatron/weights._full_tensors
    gathers over groups of 1), so rank 0's sync is its wire alone: 8B x 2 bytes over 25 GB/s."""
    n = qwen3_params(H, 36, 32, 8, 128, 12288, V, tied=False)
    sync = make_plan("qwen3_8b_grpo_mindspeed_npu", ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1"],
                     link_gbps=200)["weight_sync"]
    assert sync["rank0"]["gather_s"] == 0
    assert sync["rank0"]["expected_s"] == pytest.approx(2 * n / 25e9 / 0.7, rel=1e-3)
    # so delta sync behind rank 0 is not held to a gather: its changed 2% with int32 indices
    delta_wire = n * 0.02 * (4 + 2) / 25e9
    device = n * 2 / 2**30 * (0.0041 + 0.0016)
    assert sync["delta"]["expected_s"] == pytest.approx(delta_wire / 0.7 + device, abs=2e-3)
    # TP2 (the recipe): rank 0 does gather
    assert make_plan("qwen3_8b_grpo_mindspeed_npu", [], link_gbps=200)["weight_sync"]["rank0"]["gather_s"] > 0
