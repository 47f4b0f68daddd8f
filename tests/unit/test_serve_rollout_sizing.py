"""verl sizes the rollout with rollout.nnodes x rollout.n_gpus_per_node devices in engines of
TP x DP x PP; under Serve only the rollout replicas run. A config that runs its rollout on
accelerators and sizes no Serve replicas itself gets one replica per engine, each owning the
engine's devices (resolve.py `_serve_rollout_sizing`). Nothing here starts Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meshrl.plan import make_plan
from meshrl.plan_layout import serve_launch_problems
from meshrl.serve_config import build_serve_config, render_yaml
from meshrl.train import resolve_config
from services.common.config import MeshConfig, load_config, write_resolved_config
from services.common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
VLLM_8 = ["actor_rollout_ref.rollout.name=vllm", "rollout.n_gpus_per_node=8",
          "actor_rollout_ref.rollout.tensor_model_parallel_size=4"]


def _sizing(cfg: MeshConfig) -> tuple[float, int, dict[str, float]]:
    app = cfg.serve.rollout
    return app.num_gpus, app.num_replicas, app.resources


@pytest.mark.parametrize(("recipe", "sizing"), [
    # 1 node x 8 GPUs in engines of TP 4: two replicas of 4 GPUs (was one replica reserving none)
    ("qwen3_5_27b_grpo_fsdp", (4.0, 2, {})),
    ("qwen3_5_122b_a10b_grpo_megatron", (8.0, 4, {})),  # 4 x 8 GPUs, TP 8
    ("qwen3_30b_a3b_dapo_fsdp_npu", (0.0, 8, {"NPU": 2.0})),  # 16 NPUs, TP 2
    ("qwen3_8b_grpo_mindspeed_npu", (0.0, 4, {"NPU": 2.0})),  # 8 NPUs, TP 2
    # TP 8 x DP 8 = 64 devices per engine span 4 nodes of 16: vLLM's Ray executor places them, the
    # replica reserves none; 8 x 16 = 128 devices are 2 engines (was 1 replica: 64 devices idle)
    ("qwen3_235b_a22b_grpo_megatron_npu", (0.0, 2, {})),
])
def test_recipes_get_one_serve_rollout_replica_per_engine(recipe: str, sizing: tuple, tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "recipes" / f"{recipe}.yaml")
    assert _sizing(cfg) == sizing
    assert serve_launch_problems(cfg) == []
    assert load_config(write_resolved_config(cfg, tmp_path)) == cfg


@pytest.mark.parametrize(("overrides", "sizing"), [
    (["trainer.device=cuda"], (4.0, 2, {})),  # verl's trainer.device is the device of every worker
    (["rollout_worker.device=cuda"], (4.0, 2, {})),
    (["trainer.device=npu"], (0.0, 2, {"NPU": 4.0})),
    (["trainer.device=npu", "serve.rollout.resources={accelerator_type_x: 0.1}"],
     (0.0, 2, {"accelerator_type_x": 0.1, "NPU": 4.0})),  # a placement resource is no device sizing
    (["actor_rollout_ref.rollout.engine_kwargs={vllm: {tensor_parallel_size: 2}}", "trainer.device=cuda"],
     (2.0, 4, {})),  # the TP vLLM runs
    # the user's own sizing, or no accelerator known, stays as given
    (["trainer.device=cuda", "serve.rollout.num_replicas=1"], (0.0, 1, {})),
    (["trainer.device=cuda", "serve.rollout.num_gpus=0"], (0.0, 1, {})),
    (["trainer.device=npu", "serve.rollout.resources={NPU: 4}", "serve.rollout.num_replicas=2"], (0.0, 2, {"NPU": 4.0})),
    (["trainer.device=cuda", "rollout_worker.device=cpu"], (0.0, 1, {})),
    ([], (0.0, 1, {})),  # device auto: decided on the replica, not at load
])
def test_an_accelerator_rollout_without_serve_sizing_gets_the_engines(overrides: list[str], sizing: tuple) -> None:
    assert _sizing(load_config(None, [*VLLM_8, *overrides])) == sizing


def test_the_transformers_engine_is_sized_only_on_an_explicit_accelerator() -> None:
    pool = ["rollout.n_gpus_per_node=2"]
    assert _sizing(load_config(None, [*pool, "rollout_worker.device=cuda"])) == (1.0, 2, {})
    assert _sizing(load_config(None, [*pool, "trainer.device=cuda"])) == (0.0, 1, {})  # it may share the GPU


def test_cpu_configs_are_unchanged() -> None:
    for path in [ROOT / "meshrl" / "configs" / "example.yaml", *sorted((ROOT / "configs" / "recipes" / "mini").glob("*.yaml"))]:
        assert _sizing(load_config(path)) == (0.0, 1, {}), path


@pytest.mark.parametrize("nnodes", ["1", "2"])
def test_a_node_the_engine_does_not_divide_is_refused_naming_the_keys(nnodes: str) -> None:
    # 2 nodes of 6 in engines of TP 4: 12 devices are 3 engines, but a node holds one replica of 4,
    # so the third waited unplaced for ever
    with pytest.raises(ConfigError, match=r"rollout\.n_gpus_per_node = 6 .*"
                                          r"actor_rollout_ref\.rollout\.tensor_model_parallel_size\(4\).*"
                                          r"make rollout\.n_gpus_per_node a multiple of 4"):
        load_config(None, [*VLLM_8, "rollout.n_gpus_per_node=6", f"rollout.nnodes={nnodes}", "trainer.device=cuda"])
    # sized by hand, `meshrl plan` and the launch checks refuse it
    cfg = load_config(None, [*VLLM_8, "rollout.n_gpus_per_node=6", "rollout.nnodes=2", "trainer.device=cuda",
                             "serve.rollout.num_gpus=4", "serve.rollout.num_replicas=3"])
    (problem,) = serve_launch_problems(cfg)
    assert "does not divide the rollout.n_gpus_per_node=6 devices of a node" in problem
    assert "the replicas past that wait unplaced" in problem
    with pytest.raises(ConfigError, match="not runnable") as info:
        make_plan(None, [*VLLM_8, "rollout.n_gpus_per_node=6", "rollout.nnodes=2", "serve.rollout.num_gpus=4",
                         "serve.rollout.num_replicas=3"])
    assert "make the engine's devices a divisor of 6, or rollout.n_gpus_per_node a multiple of 4" in str(info.value)


NPU_235B = ROOT / "configs" / "recipes" / "qwen3_235b_a22b_grpo_megatron_npu.yaml"


@pytest.mark.parametrize(("sizing", "fix"), [
    # 64 NPUs reserved per replica: no 16-NPU node has them (the advice was to set exactly that)
    (["serve.rollout.resources={NPU: 64}", "serve.rollout.num_replicas=2"], "set serve.rollout.resources.NPU=0 and "
                                                                            "serve.rollout.num_replicas=2"),
    # its per-node share: vLLM's own placement group cannot use them, 16 NPUs idle or that group unplaced
    (["serve.rollout.resources={NPU: 16}", "serve.rollout.num_replicas=2"], "set serve.rollout.resources.NPU=0"),
    # no reservation, one replica: one engine of 64 ran, the other 64 devices idle
    (["serve.rollout.num_replicas=1"], "set serve.rollout.num_replicas=2"),
])
def test_an_engine_larger_than_a_node_reserves_nothing_one_replica_per_engine(sizing: list[str], fix: str) -> None:
    problems = serve_launch_problems(load_config(NPU_235B, sizing))
    assert len(problems) == 1 and fix in problems[0], problems
    assert "set serve.rollout.resources.NPU=64" not in problems[0]
    assert serve_launch_problems(load_config(NPU_235B, ["serve.rollout.num_replicas=2"])) == []


def test_an_engine_spanning_part_of_a_node_is_refused_naming_the_keys() -> None:
    # 24 devices an engine over nodes of 16: one node and a half, no layout places it
    tp24 = ["actor_rollout_ref.rollout.engine_kwargs={vllm: {tensor_parallel_size: 3}}", "rollout.nnodes=3",
            "actor_rollout_ref.rollout.expert_parallel_size=24"]  # vLLM's EP is the engine's TP x DP
    with pytest.raises(ConfigError, match=r"engine_kwargs\.vllm\.tensor_parallel_size\(3\).*= 24 devices per engine span "
                                          r"nodes of rollout\.n_gpus_per_node=16.*multiple of 16"):
        load_config(NPU_235B, tp24)
    problems = serve_launch_problems(load_config(NPU_235B, [*tp24, "serve.rollout.num_replicas=2"]))
    assert any("no whole number of nodes" in p and "rollout.n_gpus_per_node" in p for p in problems), problems


def test_plan_and_serve_config_show_the_filled_replicas(tmp_path: Path) -> None:
    plan = make_plan("qwen3_5_27b_grpo_fsdp", [])
    rollout = plan["layout"]["rollout"]
    assert (rollout["serve_replicas"], rollout["devices_per_replica"]) == (2, 4.0)
    cfg = resolve_config(str(ROOT / "configs" / "recipes" / "qwen3_5_27b_grpo_fsdp.yaml"),
                         ["serve.grpc_port=9100", "param_server.port=50100"])
    run_dir = tmp_path / "run"
    doc = yaml.safe_load(render_yaml(build_serve_config(cfg, run_dir), cfg, run_dir, "test"))
    (entry,) = next(a for a in doc["applications"] if a["name"] == "rollout")["deployments"]
    assert entry["num_replicas"] == 2 and entry["ray_actor_options"]["num_gpus"] == 4.0


def test_the_transformers_engine_is_one_device_per_replica_whatever_its_parallel_sizes() -> None:
    """The transformers engine runs on one device and reads no parallel size (only vLLM does): a
    verl TP left in the config reserved TP devices per replica, all but one idle, and a pool that TP
    did not divide was refused at load."""
    tp2 = ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "rollout_worker.device=cuda"]
    for pool in (4, 3):
        cfg = load_config(None, [*tp2, f"rollout.n_gpus_per_node={pool}"])
        assert _sizing(cfg) == (1.0, pool, {})
        assert serve_launch_problems(cfg) == []


def test_a_pool_smaller_than_one_engine_names_rollout_n_gpus_per_node_first() -> None:
    # vLLM TP 2 on a 2-GPU box with verl's default rollout.n_gpus_per_node=1: the refusal spoke of
    # engines spanning nodes of 1 device; the fix is almost always the pool's size.
    with pytest.raises(ConfigError, match=r"is smaller than one engine; set rollout.n_gpus_per_node .*=2\)"):
        load_config(None, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                           "trainer.device=cuda"])
    cfg = load_config(None, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                             "trainer.device=cuda", "rollout.n_gpus_per_node=2"])
    assert (cfg.serve.rollout.num_gpus, cfg.serve.rollout.num_replicas) == (2.0, 1)
