"""Config → engine arguments, worker settings and Serve options for the rollout service."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from meshrl.v1 import common_pb2
from services.common.config import load_config
from services.common.errors import ConfigError, InvalidArgument
from services.rollout import convert, factory
from services.rollout.deployment import CLOSE_TIMEOUT_S, DRAIN_TIMEOUT_S, deployment_options, in_flight_policy
from services.rollout.engines import get_engine_cls
from services.rollout.engines.vllm_args import engine_args_from_config

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_knobs_come_from_the_rollout_config() -> None:
    cfg = load_config(None, [
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
        "actor_rollout_ref.rollout.max_num_seqs=32",
        "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
        "actor_rollout_ref.rollout.enable_chunked_prefill=false",
        "actor_rollout_ref.rollout.enable_prefix_caching=false",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.expert_parallel_size=2",
        "actor_rollout_ref.rollout.engine_kwargs={vllm: {swap_space: 1}}",
    ])
    args = engine_args_from_config("/m", cfg.actor_rollout_ref.rollout, max_model_len=1024, seed=3, device="cuda")
    assert args["model"] == "/m" and args["max_model_len"] == 1024 and args["seed"] == 3
    assert args["gpu_memory_utilization"] == 0.7 and args["max_num_seqs"] == 32
    assert args["max_num_batched_tokens"] == 4096 and args["enable_chunked_prefill"] is False
    assert args["enable_prefix_caching"] is False and args["enforce_eager"] is True
    assert args["tensor_parallel_size"] == 2 and args["enable_expert_parallel"] is True
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["worker_extension_cls"].endswith("MeshrlWorkerExtension")
    assert args["enable_sleep_mode"] is True  # free_cache_engine on a GPU
    assert args["swap_space"] == 1
    assert engine_args_from_config("/m", cfg.actor_rollout_ref.rollout, device="cpu")["enable_sleep_mode"] is False


def test_worker_settings_follow_async_training() -> None:
    cfg = load_config(None, [
        "async_training.partial_rollout_mode=keep", "async_training.concurrent_samples_per_replica=5",
        "coordinator.lease_timeout_s=90", "data.truncation=left",
    ])
    s = factory.worker_settings(cfg, "r1")
    assert (s.replica_id, s.concurrent_groups, s.partial_rollout_mode) == ("r1", 5, "keep")
    assert s.truncation == "left"
    # The renewal is the replica's heartbeat: a quarter of the coordinator's replica TTL (20 s),
    # or a third of the lease timeout when the TTL is off.
    assert s.renew_interval_s == 5
    assert factory.worker_settings(load_config(None, ["coordinator.lease_timeout_s=90", "coordinator.replica_ttl_s=null"]),
                                   "r1").renew_interval_s == 30


def test_max_resubmits_is_one_config_key_for_the_worker_the_agent_loop_and_the_gateway() -> None:
    """How often a generation cut by weight updates is continued was 64, hard-coded in the worker
    (single-turn and the agent loop) and the gateway: a run whose updates outpaced long generations
    failed its groups (the gateway: 503 resubmit_limit) with nothing to raise."""
    from services.common.tiny import build_tokenizer
    from services.rollout.gateway import build_gateway_agent

    cfg = load_config(None, ["async_training.max_resubmits=7"])
    assert factory.worker_settings(cfg, "r1").max_resubmits == 7
    agent = build_gateway_agent(cfg, build_tokenizer(tools=True), scorer=None, max_model_len=512)
    assert agent.registry.limits.max_resubmits == 7
    assert factory.worker_settings(load_config(None, []), "r1").max_resubmits == 64
    with pytest.raises(ConfigError, match="max_resubmits"):
        load_config(None, ["async_training.max_resubmits=0"])


def test_heartbeat_slower_than_half_the_replica_ttl_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"lease_renew_interval_s=15.0 is the replicas. heartbeat and must be at most half of coordinator.replica_ttl_s=20.0"):
        load_config(None, ["rollout_worker.lease_renew_interval_s=15"])


def test_more_concurrent_groups_than_the_coordinator_takes_per_call_is_refused() -> None:
    """A replica leases all its free slots in one LeasePrompts, which the coordinator refuses
    above max_groups_per_call: the replica leased nothing, ever, and stayed healthy."""
    with pytest.raises(ConfigError, match=r"concurrent_samples_per_replica=16 is more than coordinator.max_groups_per_call=8.*"
                                          r"set coordinator.max_groups_per_call=16"):
        load_config(None, ["coordinator.max_groups_per_call=8"])
    load_config(None, ["coordinator.max_groups_per_call=8", "async_training.concurrent_samples_per_replica=8"])


@pytest.mark.parametrize("value", ["0", "two", "true", "1.5"])
def test_engine_kwargs_vllm_parallel_sizes_that_are_no_device_count_are_refused(value: str) -> None:
    # vLLM runs with engine_kwargs.vllm's sizes over the top-level ones (vllm_args.py), and the
    # launch checks read them (meshrl.plan_layout.rollout_parallel): 0 made `meshrl plan` die with
    # ZeroDivisionError and "two" with int()'s ValueError, neither naming the key.
    key = "actor_rollout_ref.rollout.engine_kwargs.vllm.tensor_parallel_size"
    with pytest.raises(ConfigError, match=rf"{key}=.*whole number >= 1"):
        load_config(None, ["actor_rollout_ref.rollout.name=vllm",
                           f"actor_rollout_ref.rollout.engine_kwargs={{vllm: {{tensor_parallel_size: {value}}}}}"])
    assert load_config(None, ["actor_rollout_ref.rollout.engine_kwargs={vllm: {data_parallel_size: 2}}"])


def test_vllm_expert_parallel_size_is_1_or_the_engines_tp_x_dp() -> None:
    # vLLM has no EP size: enable_expert_parallel (what expert_parallel_size > 1 turns on,
    # vllm_args.py) makes EP = TP x DP, as verl asserts. EP 2 at TP 2 x DP 2 ran EP 4 while the
    # config (and the plan's numbers) said 2.
    key = "actor_rollout_ref.rollout"
    base = [f"{key}.name=vllm", f"{key}.tensor_model_parallel_size=2", f"{key}.data_parallel_size=2"]
    with pytest.raises(ConfigError, match=rf"{key}.expert_parallel_size=2: .*TP x DP.*= 4.*set {key}.expert_parallel_size=4"):
        load_config(None, [*base, f"{key}.expert_parallel_size=2"])
    assert load_config(None, [*base, f"{key}.expert_parallel_size=4"])
    assert load_config(None, [*base, f"{key}.expert_parallel_size=1"])
    # engine_kwargs.vllm's sizes are the ones vLLM runs (rollout_parallel): EP 4 at DP 4 there is EP 8
    with pytest.raises(ConfigError, match=rf"{key}.engine_kwargs.vllm.data_parallel_size\(4\).*= 8.*expert_parallel_size=8"):
        load_config(None, [*base, f"{key}.expert_parallel_size=4", f"{key}.engine_kwargs={{vllm: {{data_parallel_size: 4}}}}"])
    # the transformers engine reads no parallel size (a verl EP left in its config loads, as its TP does)
    assert load_config(None, [f"{key}.tensor_model_parallel_size=2", f"{key}.expert_parallel_size=2"])


def test_unknown_engine_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.name='sglang'"):
        get_engine_cls("sglang")


def test_sampling_conversion_and_validation() -> None:
    spec = convert.sampling_spec(common_pb2.SamplingParams(n=0, max_tokens=5, top_k=0, seed=10), seed_offset=4)
    assert (spec.n, spec.top_p, spec.top_k, spec.seed) == (1, 1.0, -1, 14)
    with pytest.raises(InvalidArgument, match=r"sampling\.max_tokens"):
        convert.sampling_spec(common_pb2.SamplingParams(n=1))
    with pytest.raises(InvalidArgument, match=r"sampling\.top_k"):
        convert.sampling_spec(common_pb2.SamplingParams(n=1, max_tokens=3, top_k=-5))


def test_prompt_truncation() -> None:
    from services.common.tiny import build_tokenizer

    tok = build_tokenizer()
    p = common_pb2.Prompt(prompt_id="x:1", text="abcdefgh")
    for truncation, kept in (("left", "efgh"), ("middle", "abgh")):
        encoded = convert.encode_prompt(p, tok, max_prompt_length=4, truncation=truncation)
        assert tok.decode(encoded.token_ids) == kept and encoded.text == kept
    whole = convert.encode_prompt(p, tok, max_prompt_length=8)
    assert whole.text == "abcdefgh" and tok.decode(whole.token_ids) == "abcdefgh"
    with pytest.raises(InvalidArgument, match=r"data\.max_prompt_length"):
        convert.encode_prompt(p, tok, max_prompt_length=4, truncation="error")


def test_serve_options_and_in_flight_autoscaling() -> None:
    cfg = load_config(None, [
        "serve.rollout.num_gpus=1", "serve.rollout.resources={NPU: 0}",
        "serve.rollout.autoscaling={min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}",
    ])
    opts = deployment_options(cfg.serve.rollout)
    assert opts["ray_actor_options"]["num_gpus"] == 1 and "num_replicas" not in opts
    assert opts["autoscaling_config"]["policy"]["policy_function"].endswith(":in_flight_policy")
    # Serve kills a replica still shutting down after graceful_shutdown_timeout_s: the drain fits.
    assert opts["graceful_shutdown_timeout_s"] >= DRAIN_TIMEOUT_S + CLOSE_TIMEOUT_S

    def ctx(values: list[float]) -> SimpleNamespace:
        return SimpleNamespace(
            aggregated_metrics={"groups_in_flight": dict(enumerate(values))},
            config=SimpleNamespace(target_ongoing_requests=8),
            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
        )

    assert in_flight_policy(ctx([16, 16]))[0] == 4
    assert in_flight_policy(ctx([8, 4]))[0] == 2
    assert in_flight_policy(ctx([0, 0]))[0] == 1
    assert in_flight_policy(ctx([100]))[0] == 4


_ROLLOUT_8 = ["actor_rollout_ref.rollout.name=vllm", "rollout.n_gpus_per_node=8"]


@pytest.mark.parametrize(("overrides", "backends"), [
    # within a node vLLM's own choice stays (its multiprocessing executor, one process per device)
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=4"], (None, None)),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=4", "actor_rollout_ref.rollout.data_parallel_size=2"],
     (None, None)),
    # larger than a node: the replica reserves no device, and only vLLM's Ray executor (and Ray data
    # parallel for DP > 1) places the engine's workers on other nodes; the multiprocessing one ran
    # them all on the replica's node (or refused: more workers than the node's devices)
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=16"], ("ray", None)),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=4",
      "actor_rollout_ref.rollout.engine_kwargs={vllm: {pipeline_parallel_size: 4}}"], ("ray", None)),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=8", "actor_rollout_ref.rollout.data_parallel_size=2"],
     ("ray", "ray")),
    (["actor_rollout_ref.rollout.engine_kwargs={vllm: {tensor_parallel_size: 8, data_parallel_size: 4}}"],
     ("ray", "ray")),  # the sizes vLLM runs with
    # the user's own choice wins
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=8", "actor_rollout_ref.rollout.data_parallel_size=2",
      "actor_rollout_ref.rollout.engine_kwargs={vllm: {distributed_executor_backend: mp, data_parallel_backend: mp}}"],
     ("mp", "mp")),
])
def test_an_engine_larger_than_a_node_runs_on_vllms_ray_backends(overrides: list[str], backends: tuple) -> None:
    cfg = load_config(None, _ROLLOUT_8 + overrides)
    args = factory.vllm_engine_args(cfg, "/m", device="cuda")
    assert (args.get("distributed_executor_backend"), args.get("data_parallel_backend")) == backends


def test_the_npu_recipe_whose_engine_spans_nodes_runs_on_ray() -> None:
    # TP 8 x DP 8 = 64 NPUs per engine on nodes of 16 (its Serve replica reserves none)
    cfg = load_config(ROOT / "configs" / "recipes" / "qwen3_235b_a22b_grpo_megatron_npu.yaml")
    args = factory.vllm_engine_args(cfg, "/m", device="npu")
    assert args["distributed_executor_backend"] == "ray" and args["data_parallel_backend"] == "ray"
