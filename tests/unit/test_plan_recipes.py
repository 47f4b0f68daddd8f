"""`meshrl plan` on the seed recipes: derived numbers, layouts, memory, and rejections that
name the fix. No hardware, no data files, no model hub (the known-config table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshrl.cli import main
from meshrl.plan import RECIPES_DIR, make_plan
from services.common.config import derive
from services.common.errors import ConfigError

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_all_recipes_present_and_plan() -> None:
    assert RECIPES == [
        "qwen3_235b_a22b_grpo_megatron_npu", "qwen3_30b_a3b_dapo_fsdp_npu", "qwen3_5_122b_a10b_grpo_megatron",
        "qwen3_5_27b_grpo_fsdp", "qwen3_8b_grpo_mindspeed_npu",
    ]
    for name in RECIPES:
        plan = make_plan(name, [])
        mem = plan["memory"]["trainer_per_rank"]
        assert mem["param_bytes"] > 0 and mem["optimizer_bytes"] > 0, name


def test_recipe1_qwen3_235b_numbers() -> None:
    plan = make_plan("qwen3_235b_a22b_grpo_megatron_npu", [])
    assert plan["derived"]["max_required_samples"] == 192
    assert plan["derived"]["total_train_steps"] == 1600
    mg = plan["layout"]["trainer"]["megatron"]
    assert mg["layers_per_stage"] == [11, 12, 12, 12, 12, 12, 12, 11]
    assert (mg["data_parallel"], mg["expert_parallel"], mg["expert_tensor_parallel"], mg["expert_data_parallel"]) == (4, 4, 4, 1)
    assert plan["layout"]["trainer"]["world_size"] == 128 and plan["layout"]["rollout"]["engines"] == 2
    assert plan["model"]["experts"] == 128 and 230e9 < plan["model"]["params"] < 240e9
    mem = plan["memory"]["trainer_per_rank"]
    # Everything offloaded: nothing resident between steps; a middle stage (12 layers) is the largest.
    assert mem["device_at_rest_gib"] == 0 and mem["stage"] in range(1, 7)
    # 12 layers of ~2.45B params / (ETP4 x EP4) experts + attention / TP4, about 2.0e9 params per rank.
    assert 1.8e9 < mem["params"] < 2.2e9


def test_recipe2_qwen3_30b_numbers() -> None:
    plan = make_plan("qwen3_30b_a3b_dapo_fsdp_npu", [])
    assert plan["derived"]["max_required_samples"] == 56
    assert plan["derived"]["total_train_steps"] == 100
    assert plan["memory"]["trainer_per_rank"]["params"] == pytest.approx(plan["model"]["params"] / 16, rel=1e-6)


@pytest.mark.parametrize(
    ("recipe", "overrides", "fix"),
    [
        ("qwen3_5_122b_a10b_grpo_megatron", ["actor_rollout_ref.model.use_remove_padding=true"],
         "set actor_rollout_ref.model.use_remove_padding=false"),
        ("qwen3_5_27b_grpo_fsdp", ["actor_rollout_ref.model.use_remove_padding=true"], "use_remove_padding=false"),
        ("qwen3_235b_a22b_grpo_megatron_npu", ["trainer.n_gpus_per_node=10"], "= 32 does not divide the 80 training devices"),
        ("qwen3_235b_a22b_grpo_megatron_npu", ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=3"],
         "does not divide the model's 128 experts"),
        ("qwen3_235b_a22b_grpo_megatron_npu",
         ["actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=10"],
         "num_layers_in_first_pipeline_stage"),
        ("qwen3_30b_a3b_dapo_fsdp_npu", ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"],
         "ulysses_sequence_parallel_size=3 does not divide"),
        ("qwen3_8b_grpo_mindspeed_npu", ["trainer.device=cuda"], "set trainer.device=npu"),
        ("qwen3_8b_grpo_mindspeed_npu", ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"],
         "TP(3) x PP(1) x CP(1) = 3 does not divide"),
    ],
)
def test_rejections_name_the_fix(recipe: str, overrides: list[str], fix: str) -> None:
    with pytest.raises(ConfigError, match="not runnable") as info:
        make_plan(recipe, overrides)
    assert fix in str(info.value)


def test_rollout_expert_parallel_is_the_one_vllm_runs() -> None:
    """vLLM's EP is TP x DP when enable_expert_parallel is on, and engine_kwargs.vllm's flag is
    passed over expert_parallel_size's (vllm_args.py). The plan read only expert_parallel_size:
    EP 1 with the flag set in engine_kwargs said EP 1 and 6x the expert weights per device of the
    EP 64 vLLM ran; EP 64 with the flag off said 1/6 of what each device holds."""
    key = "actor_rollout_ref.rollout"
    ep64 = make_plan("qwen3_235b_a22b_grpo_megatron_npu", [])
    assert ep64["layout"]["rollout"]["expert_parallel"] == 64
    on = make_plan("qwen3_235b_a22b_grpo_megatron_npu",
                   [f"{key}.expert_parallel_size=1", f"{key}.engine_kwargs.vllm.enable_expert_parallel=true"])
    assert on["layout"]["rollout"]["expert_parallel"] == 64
    assert on["memory"]["rollout_weights_per_device_gib"] == ep64["memory"]["rollout_weights_per_device_gib"]
    off = make_plan("qwen3_235b_a22b_grpo_megatron_npu", [f"{key}.engine_kwargs.vllm.enable_expert_parallel=false"])
    tp8 = make_plan("qwen3_235b_a22b_grpo_megatron_npu", [f"{key}.expert_parallel_size=1"])
    assert off["layout"]["rollout"]["expert_parallel"] == 1
    assert off["memory"]["rollout_weights_per_device_gib"] == tp8["memory"]["rollout_weights_per_device_gib"] > 6 * 8.4
    # an expert_parallel_size other than 1 or TP x DP is refused when the config loads
    with pytest.raises(ConfigError, match=f"set {key}.expert_parallel_size=64"):
        make_plan("qwen3_235b_a22b_grpo_megatron_npu", [f"{key}.expert_parallel_size=32"])


def test_qwen35_megatron_recipe_warns_engine_gap() -> None:
    plan = make_plan("qwen3_5_122b_a10b_grpo_megatron", [])
    assert plan["model"]["linear_attention_layers"] == 36 and plan["model"]["verified"] is False
    assert any("not implemented" in w for w in plan["warnings"])


def test_local_model_path_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.common.tiny import build_tiny_model, build_tokenizer, save_pretrained_pair

    tok = build_tokenizer()
    model = build_tiny_model("qwen3_moe", tok)
    save_pretrained_pair(model, tok, tmp_path / "m")
    args = ["plan", "qwen3_235b_a22b_grpo_megatron_npu", f"actor_rollout_ref.model.path={tmp_path / 'm'}",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.override_transformer_config={}",
            "actor_rollout_ref.rollout.expert_parallel_size=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            "actor_rollout_ref.rollout.data_parallel_size=1", "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["source"] == "config.json" and plan["model"]["experts"] == 4
    assert plan["model"]["params"] == sum(p.numel() for p in model.parameters())
    assert main(["plan", "qwen3_235b_a22b_grpo_megatron_npu", "trainer.n_gpus_per_node=10"]) == 2
    assert "does not divide the 80 training devices" in capsys.readouterr().err


def test_plan_without_config_plans_the_built_in_example(capsys: pytest.CaptureFixture[str]) -> None:
    """`meshrl plan` with no CONFIG (or only overrides) plans what `meshrl train` with no CONFIG runs:
    the built-in example, as its help says. It planned the bare defaults: 0 weight versions (100
    prompts, 256 x 4 per version) where the example trains 500."""
    from meshrl.train import resolve_config

    example = derive(resolve_config(None, []), dataset_size=4096).as_dict()
    assert main(["plan", "--json"]) == 0
    assert {k: v for k, v in json.loads(capsys.readouterr().out)["derived"].items() if k in example} == example
    plan = make_plan(None, ["actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    assert plan["derived"]["required_samples"] == 16 and plan["derived"]["total_rollout_steps"] == 16000


def test_collective_receivers_other_than_the_serve_rollout_replicas_make_the_plan_not_runnable() -> None:
    # `meshrl train` / serve-config deploy the rollout under Serve, one broadcast receiver a
    # replica: 3 receivers for 2 replicas stalls every broadcast.
    backend = "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"
    with pytest.raises(ConfigError, match="not runnable") as info:
        make_plan(None, [backend, "serve.rollout.num_replicas=2", "param_server.collective_receivers=3"])
    assert "param_server.collective_receivers=3" in str(info.value) and "serve.rollout.num_replicas=2" in str(info.value)
    make_plan(None, [backend, "serve.rollout.num_replicas=2", "param_server.collective_receivers=2"])


@pytest.mark.parametrize("gpus, tp, dp, extra, fix", [
    ("1", 2, 1, [], "serve.rollout.num_gpus=2"),  # too few: vLLM's Ray executor grabs GPUs outside the replica
    ("4", 2, 1, [], "serve.rollout.num_gpus=2"),  # too many: 2 idle GPUs per replica
    ("2", 2, 2, [], "serve.rollout.num_gpus=4"),  # DP engines each need their TP GPUs
    ("2", 2, 1, ["actor_rollout_ref.rollout.engine_kwargs={vllm: {pipeline_parallel_size: 2}}"], "serve.rollout.num_gpus=4"),
])
def test_serve_rollout_gpus_other_than_the_vllm_engine_make_the_plan_not_runnable(
    gpus: str, tp: int, dp: int, extra: list[str], fix: str
) -> None:
    # One Serve rollout replica runs one vLLM engine over TP x PP x DP GPUs (vllm_args.py).
    engine = ["actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
              f"actor_rollout_ref.rollout.data_parallel_size={dp}", "rollout.n_gpus_per_node=8", *extra]
    with pytest.raises(ConfigError, match="not runnable") as info:
        make_plan(None, [*engine, f"serve.rollout.num_gpus={gpus}"])
    assert f"serve.rollout.num_gpus={gpus} " in str(info.value) and fix in str(info.value)
    assert "tensor_model_parallel_size" in str(info.value)


def test_serve_rollout_gpus_that_fit_the_vllm_engine_plan() -> None:
    # the replicas fill rollout.nnodes x rollout.n_gpus_per_node (serve_rollout_pool_mismatch)
    vllm = ["actor_rollout_ref.rollout.name=vllm", "rollout.n_gpus_per_node=8"]
    make_plan(None, [*vllm, "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "serve.rollout.num_replicas=4",
                     "serve.rollout.num_gpus=2"])
    make_plan(None, ["actor_rollout_ref.rollout.name=vllm", "serve.rollout.num_replicas=2",
                     "serve.rollout.num_gpus=0.5"])  # replicas sharing one GPU
    make_plan(None, [*vllm, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])  # no GPUs reserved: left alone
    make_plan(None, ["rollout.n_gpus_per_node=8", "serve.rollout.num_replicas=8", "serve.rollout.num_gpus=1"])  # transformers engine


@pytest.mark.parametrize("reserve, key", [("serve.trainer.num_gpus=8", "serve.trainer.num_gpus"),
                                          ("serve.trainer.resources={NPU: 1}", "serve.trainer.resources.NPU")])
def test_devices_reserved_for_the_trainer_replica_make_the_plan_not_runnable(reserve: str, key: str) -> None:
    # The trainer replica only drives its ranks, which take their own devices (ranks.py spawn):
    # 8 GPUs for the replica sat idle and, on a 16-GPU cluster, left the 8 ranks' group unplaced.
    with pytest.raises(ConfigError, match="not runnable") as info:
        make_plan(None, ["trainer.n_gpus_per_node=8", reserve])
    assert f"{key}=" in str(info.value) and "trainer.n_gpus_per_node = 8 ranks" in str(info.value)
    assert f"set {key}=0" in str(info.value)


def test_rollout_sizes_given_in_engine_kwargs_vllm_are_the_ones_checked() -> None:
    # vllm_args.py passes engine_kwargs.vllm over actor_rollout_ref.rollout's sizes, so vLLM runs
    # TP 3 here; the plan checked (and reported) the top-level TP 1 and called runnable an engine
    # that cannot split the tiny model's 4 attention heads nor fit in the 2 rollout devices.
    vllm = ["actor_rollout_ref.rollout.name=vllm", "rollout.n_gpus_per_node=2"]
    with pytest.raises(ConfigError, match="not runnable") as info:
        make_plan(None, [*vllm, "actor_rollout_ref.rollout.engine_kwargs={vllm: {tensor_parallel_size: 3}}"])
    msg = str(info.value)
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.tensor_parallel_size=3 must divide the 4 attention heads" in msg
    assert "= 3 devices per engine does not divide the 2 rollout devices" in msg
    plan = make_plan(None, [*vllm, "actor_rollout_ref.rollout.engine_kwargs={vllm: {tensor_parallel_size: 2}}"])
    assert plan["layout"]["rollout"]["tensor_parallel"] == 2 and plan["layout"]["rollout"]["engines"] == 1
    # PP takes devices too: 2 x 2 does not fit in 2
    with pytest.raises(ConfigError, match=r"= 4 devices per engine does not divide the 2 rollout devices"):
        make_plan(None, [*vllm, "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                         "actor_rollout_ref.rollout.engine_kwargs={vllm: {pipeline_parallel_size: 2}}"])


def test_the_transformers_engine_is_planned_as_one_device_whatever_its_parallel_sizes() -> None:
    # The transformers engine reads no TP / DP: a verl TP 3 left in its config made the plan call
    # it unrunnable (3 does not split the tiny model's 4 heads, nor divide the 2 devices), and a
    # TP 2 count one engine where the 2 rollout devices run two.
    base = ["actor_rollout_ref.rollout.name=transformers", "rollout.n_gpus_per_node=2"]
    plan = make_plan(None, [*base, "actor_rollout_ref.rollout.tensor_model_parallel_size=3"])
    assert plan["layout"]["rollout"]["engines"] == 2 and plan["layout"]["rollout"]["devices_per_engine"] == 1
    assert plan["layout"]["rollout"]["tensor_parallel"] == 1


@pytest.mark.parametrize("serve, fix", [
    # verl sizes the rollout by rollout.nnodes x rollout.n_gpus_per_node (8): 4 engines of TP 2.
    # Serve started 1 replica of 2 GPUs and 6 of the 8 ran no engine.
    (["serve.rollout.num_gpus=2"], "set serve.rollout.num_replicas=4"),
    (["serve.rollout.num_replicas=8", "serve.rollout.num_gpus=2"], "set serve.rollout.num_replicas=4"),  # 16 > 8
    (["serve.rollout.autoscaling={min_replicas: 1, max_replicas: 2}", "serve.rollout.num_gpus=2"],
     "set serve.rollout.autoscaling.max_replicas=4"),
    (["serve.rollout.num_replicas=2", "serve.rollout.resources={NPU: 2}"], "set serve.rollout.num_replicas=4"),
])
def test_serve_rollout_devices_other_than_the_rollout_pool_make_the_plan_not_runnable(serve: list[str], fix: str) -> None:
    engine = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
              "rollout.n_gpus_per_node=8"]
    with pytest.raises(ConfigError, match="not runnable") as info:
        make_plan(None, [*engine, *serve])
    msg = str(info.value)
    assert "rollout.nnodes x rollout.n_gpus_per_node = 8" in msg and fix in msg, msg
    assert "or rollout.nnodes x rollout.n_gpus_per_node" in msg
    make_plan(None, [*engine, "serve.rollout.num_replicas=4", "serve.rollout.num_gpus=2"])
    make_plan(None, [*engine, "serve.rollout.autoscaling={min_replicas: 1, max_replicas: 4}", "serve.rollout.num_gpus=2"])
