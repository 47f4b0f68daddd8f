"""`meshrl plan --link-gbps`: the weight-sync model of meshrl/plan_sync.py."""

from __future__ import annotations

import json

import pytest

from meshrl.cli import main
from meshrl.plan import make_plan


def test_235b_recipe_on_128_plus_128_npus() -> None:
    sync = make_plan("qwen3_235b_a22b_grpo_megatron_npu", [], link_gbps=200)["weight_sync"]
    assert sync["bytes_per_version"] == 235_093_634_560 * 2  # bf16
    # rank 0: every byte through one 25 GB/s link, the gather at the same pace
    assert sync["rank0"]["wire_s"] == pytest.approx(470.187 / 25, rel=1e-3)
    assert sync["rank0"]["expected_s"] == pytest.approx(sync["rank0"]["wire_s"] / 0.7, rel=1e-3)
    # every rank: 128 senders, but a rollout node takes in at most its 16 links' worth
    assert sync["every_rank"]["senders"] == 128
    assert sync["every_rank"]["wire_s"] == pytest.approx(470.187 / (16 * 25), rel=1e-3)
    assert sync["speedup_every_rank"] == pytest.approx(16, rel=1e-2)
    assert sync["every_rank"]["available"] is True and "collective_sharded=true" in sync["note"]  # not set here


def test_megatron_replicas_send_nothing_and_the_most_loaded_rank_can_set_the_pace() -> None:
    """megatron's every-rank sync: dense bytes leave one data-parallel replica's TP x PP ranks,
    expert bytes one expert-data-parallel replica's EP x ETP x PP ranks. Without expert
    parallelism each of the 8 stages' ranks carries an eighth of the 227B expert parameters, and
    that rank's link, not the receiving node, sets the pace."""
    base = make_plan("qwen3_235b_a22b_grpo_megatron_npu", [], link_gbps=200)["weight_sync"]["every_rank"]
    no_ep = ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
             "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1"]
    plan = make_plan("qwen3_235b_a22b_grpo_megatron_npu", no_ep, link_gbps=200)
    sync = plan["weight_sync"]["every_rank"]
    assert base["senders"] == 128  # TP4 x PP8 dense owners, EP4 x ETP4 x PP8 expert owners
    assert sync["senders"] == 32  # TP4 x PP8 (data-parallel replicas: 4, of which one sends)
    expert_gb = plan["model"]["params_by_kind"]["expert"] * 2 / 1e9
    # the stages hold 11-12 of the 94 layers: the largest stage's experts over one 25 GB/s link
    assert sync["wire_s"] == pytest.approx(expert_gb * 12 / 94 / 25, rel=0.02)
    assert sync["wire_s"] > 470.187 / (16 * 25)  # the sender's link, not the receiving node, sets the pace


def test_time_falls_with_senders_until_the_receiving_node_saturates() -> None:
    base = ["trainer.nnodes=1", "rollout.nnodes=1", "rollout.n_gpus_per_node=4",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "param_server.collective_sharded=true"]
    wire = {}
    for n in (1, 2, 4, 8):
        sync = make_plan("qwen3_5_27b_grpo_fsdp", [*base, f"trainer.n_gpus_per_node={n}"], link_gbps=400)["weight_sync"]
        assert sync["mode"] == "every_rank"
        wire[n] = sync["every_rank"]["wire_s"]
        assert sync["rank0"]["gather_s"] == (0 if n == 1 else sync["rank0"]["wire_s"])
    assert wire[2] == pytest.approx(wire[1] / 2, rel=1e-3)
    assert wire[4] == pytest.approx(wire[1] / 4, rel=1e-3)
    assert wire[8] == wire[4]  # 4 rollout devices per node: 4 links in


def test_cli_flag_and_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "qwen3_5_27b_grpo_fsdp", "--link-gbps", "100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weight_sync"]["link_gbps"] == 100
    assert "weight_sync" not in make_plan("qwen3_5_27b_grpo_fsdp", [])
    with pytest.raises(ValueError, match="link-gbps"):
        make_plan("qwen3_5_27b_grpo_fsdp", [], link_gbps=0)


SHARDED = ["trainer.nnodes=1", "trainer.n_gpus_per_node=8", "rollout.nnodes=1", "rollout.n_gpus_per_node=8",
           "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "param_server.collective_sharded=true",
           "actor_rollout_ref.rollout.dtype=bfloat16"]


def test_delta_sync_on_a_slow_link_sends_the_changed_elements_with_their_indices() -> None:
    sync = make_plan("qwen3_5_27b_grpo_fsdp", [*SHARDED, "param_server.delta_sync=true"], link_gbps=100,
                     changed_fraction=0.02)["weight_sync"]
    params = sync["bytes_per_version"] // 2  # bf16 export
    delta = sync["delta"]
    assert delta["enabled"] and delta["available"]
    assert delta["bytes_per_version"] == int(params * 0.02 * (4 + 2))  # int32 index + bf16 value
    assert delta["wire_s"] == pytest.approx(delta["bytes_per_version"] / (8 * 12.5e9), rel=1e-2)
    # the device work: each of 8 senders encodes its part, every receiver rebuilds the whole
    assert delta["device_s"] == pytest.approx(params * 2 / 2**30 * (0.0041 / 8 + 0.0016), rel=1e-2)
    assert delta["expected_s"] == pytest.approx(delta["wire_s"] / 0.7 + delta["device_s"], abs=2e-3)
    assert delta["vs_whole"] < 0.5  # 6% of the bytes on a 100 Gbit/s link


def test_delta_sync_behind_rank_0s_gather_saves_nothing() -> None:
    base = [s for s in SHARDED if not s.startswith("param_server.collective_sharded")]
    sync = make_plan("qwen3_5_27b_grpo_fsdp", base, link_gbps=400)["weight_sync"]
    assert sync["mode"] == "rank0" and sync["delta"]["gather_s"] == sync["rank0"]["gather_s"] > 0
    assert sync["delta"]["vs_whole"] >= 1  # the full tensors still cross rank 0's link to be gathered


def test_a_delta_never_carries_more_than_the_whole_version() -> None:
    sync = make_plan("qwen3_5_27b_grpo_fsdp", SHARDED, link_gbps=100, changed_fraction=1.0)["weight_sync"]
    assert sync["delta"]["bytes_per_version"] == sync["bytes_per_version"]  # bf16 wire, every element changed
    assert sync["delta"]["enabled"] is False  # delta_sync off in the config: an estimate all the same


def test_delta_sync_is_marked_unavailable_without_a_collective_transport_and_bad_fractions_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    sync = make_plan("qwen3_5_27b_grpo_fsdp", [], link_gbps=100)["weight_sync"]
    assert sync["delta"]["changed_fraction"] == 0.02
    grpc = make_plan("qwen3_5_27b_grpo_fsdp", ["actor_rollout_ref.rollout.checkpoint_engine.backend=grpc"],
                     link_gbps=100)["weight_sync"]
    assert grpc["delta"]["available"] is False
    with pytest.raises(ValueError, match="changed-fraction"):
        make_plan("qwen3_5_27b_grpo_fsdp", [], link_gbps=100, changed_fraction=1.5)
    assert main(["plan", "qwen3_5_27b_grpo_fsdp", "--link-gbps", "100", "--changed-fraction", "0.05", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_sync"]["delta"]["changed_fraction"] == 0.05
