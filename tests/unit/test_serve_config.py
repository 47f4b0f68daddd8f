"""`meshrl serve-config`: the YAML is a config Ray's `serve deploy` accepts (ServeDeploySchema, and
every application built the way Serve builds it), wired like `meshrl train`, with the resources
of `serve.<app>` and the trainer's ranks spelled out. Nothing here starts Ray."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from meshrl.cli import main
from meshrl.serve_config import APP_IMPORT_PATHS, build_application, build_serve_config, render_yaml
from meshrl.train import resolve_config
from services.common.config import MeshConfig
from services.common.errors import ConfigError
from services.common.serve_util import SERVICER_FUNCTIONS

DEPLOYMENTS = {"coordinator": "Coordinator", "param_server": "ParamServer", "reward": "Reward",
               "trainer": "Trainer", "rollout": "Rollout"}


def _yaml(tmp_path: Path, *overrides: str) -> tuple[str, dict[str, Any]]:
    cfg = resolve_config(None, ["serve.grpc_port=9100", "param_server.port=50100", *overrides])
    run_dir = tmp_path / "run"
    text = render_yaml(build_serve_config(cfg, run_dir), cfg, run_dir, "meshrl serve-config (test)")
    return text, yaml.safe_load(text)


def _deployment(doc: dict[str, Any], app: str) -> dict[str, Any]:
    (entry,) = next(a for a in doc["applications"] if a["name"] == app)["deployments"]
    return entry  # type: ignore[no-any-return]


def test_the_yaml_is_a_serve_deploy_config_with_one_routed_app_per_service(tmp_path: Path) -> None:
    text, doc = _yaml(tmp_path)
    schema = ServeDeploySchema.model_validate(doc)
    assert [a.name for a in schema.applications] == list(APP_IMPORT_PATHS)
    for app in schema.applications:
        assert app.route_prefix == f"/{app.name}"  # the gRPC ingress only routes to apps with one
        assert [d.name for d in app.deployments] == [DEPLOYMENTS[app.name]]
        assert app.runtime_env["env_vars"]["MESHRL_LOG_DIR"] == str(tmp_path / "run" / "logs")
        # what `serve deploy` does with the entry: import the builder, call it with args (one argument)
        built = build_application(app.import_path, app.args)
        assert built._bound_deployment.name == DEPLOYMENTS[app.name]
    assert schema.grpc_options.port == 9100
    assert schema.grpc_options.grpc_servicer_functions == SERVICER_FUNCTIONS
    assert schema.proxy_location.value == "EveryNode"  # services dial 127.0.0.1 on their own node
    assert schema.logging_config is not None and schema.logging_config.encoding == "JSON"
    # one config, written once: the other four apps alias it
    assert text.count("args: &mesh") == 1 and text.count("args: *mesh") == 4
    assert all(a["args"] == doc["applications"][0]["args"] for a in doc["applications"])
    # key order readable: the app's identity first, the big config last
    assert list(doc["applications"][0]) == ["name", "route_prefix", "import_path", "runtime_env", "deployments", "args"]
    assert list(doc) == ["proxy_location", "http_options", "grpc_options", "logging_config", "applications"]


def test_the_config_is_wired_like_meshrl_train(tmp_path: Path) -> None:
    _, doc = _yaml(tmp_path)
    args = doc["applications"][0]["args"]
    assert args["run_dir"] == str(tmp_path / "run")
    cfg = MeshConfig.model_validate(args["config"])
    assert cfg.rollout_worker.coordinator_address == "127.0.0.1:9100"
    assert cfg.rollout_worker.coordinator_application == "coordinator"
    assert cfg.rollout_worker.reward_application == "reward"
    assert cfg.trainer_service.coordinator_address == "127.0.0.1:9100"
    assert cfg.trainer_service.coordinator_application == "coordinator"
    assert cfg.trainer_service.publisher == "param_server"
    assert cfg.serve.grpc_port == 9100 and cfg.serve.proxy_location == "EveryNode"


def test_replicas_and_resources_come_from_the_serve_sections(tmp_path: Path) -> None:
    _, doc = _yaml(
        tmp_path, "rollout.n_gpus_per_node=3", "serve.rollout.num_replicas=3", "serve.rollout.num_cpus=4",
        "serve.rollout.resources={NPU: 1}",
        "serve.reward.num_gpus=0.25", "serve.reward.num_cpus=0.5", "serve.coordinator.num_cpus=2", "serve.trainer.num_cpus=0.5",
    )
    ServeDeploySchema.model_validate(doc)
    rollout = _deployment(doc, "rollout")
    assert rollout["num_replicas"] == 3
    assert rollout["ray_actor_options"] == {"num_cpus": 4.0, "resources": {"NPU": 1.0}}
    assert _deployment(doc, "reward")["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.25}
    assert _deployment(doc, "coordinator")["ray_actor_options"] == {"num_cpus": 2.0}
    assert _deployment(doc, "coordinator")["max_ongoing_requests"] == 1024  # the deployment's own choice
    assert _deployment(doc, "trainer") | {} == {"name": "Trainer", "num_replicas": 1, "max_ongoing_requests": 64,
                                                 "ray_actor_options": {"num_cpus": 0.5}, "health_check_period_s": 10.0}


def test_rollout_autoscaling_uses_the_in_flight_policy(tmp_path: Path) -> None:
    text, doc = _yaml(tmp_path, "serve.rollout.autoscaling={min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}")
    ServeDeploySchema.model_validate(doc)
    rollout = _deployment(doc, "rollout")
    assert "num_replicas" not in rollout
    auto = rollout["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 4, 8.0)
    assert auto["policy"] == {"policy_function": "services.rollout.deployment:in_flight_policy"}
    assert "1..4 (autoscaling)" in text


def test_trainer_ranks_are_documented_from_the_trainer_section(tmp_path: Path) -> None:
    text, doc = _yaml(tmp_path, "trainer.device=npu", "trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                      "trainer_service.worker_num_cpus=4")
    assert "16 bundle(s) of" in text and "{CPU: 4, NPU: 1}, strategy PACK" in text
    assert "trainer ranks 16 x {CPU: 4, NPU: 1}" in text
    cfg = MeshConfig.model_validate(doc["applications"][0]["args"]["config"])
    assert (cfg.trainer.device, cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == ("npu", 2, 8)
    text, _ = _yaml(tmp_path, "trainer.device=cuda", "trainer.n_gpus_per_node=4")
    assert "trainer ranks 4 x {CPU: 1, GPU: 1}" in text


def test_multi_node_is_one_switch_and_placement_is_by_resources(tmp_path: Path) -> None:
    text, doc = _yaml(
        tmp_path, "param_server.host=0.0.0.0", "serve.coordinator.resources={node_a: 1}",
        "serve.param_server.resources={node_a: 1}", "serve.rollout.resources={node_b: 1}", "serve.rollout.num_replicas=2",
        "serve.trainer.resources={node_c: 1}", "trainer_service.worker_resources={node_c: 1}",
    )
    ServeDeploySchema.model_validate(doc)
    resources = {app: _deployment(doc, app)["ray_actor_options"].get("resources") for app in DEPLOYMENTS}
    assert resources == {"coordinator": {"node_a": 1.0}, "param_server": {"node_a": 1.0}, "reward": None,
                         "trainer": {"node_c": 1.0}, "rollout": {"node_b": 1.0}}
    assert "trainer ranks 1 x {CPU: 1, node_c: 1}" in text
    assert "data plane <its node's IP>:50100" in text
    assert not re.search(r"node:(<|\d)", text)  # nothing pinned to a node by IP (Ray's node:<ip> resource)
    cfg = MeshConfig.model_validate(doc["applications"][0]["args"]["config"])
    assert (cfg.param_server.host, cfg.param_server.advertise_address) == ("0.0.0.0", None)
    _, doc = _yaml(tmp_path, "param_server.host=0.0.0.0", "param_server.port=0")  # consumers ask for the port too
    assert MeshConfig.model_validate(doc["applications"][0]["args"]["config"]).param_server.port == 0


def test_an_explicit_proxy_location_is_kept(tmp_path: Path) -> None:
    _, doc = _yaml(tmp_path, "serve.proxy_location=HeadOnly")
    assert doc["proxy_location"] == "HeadOnly"


@pytest.mark.parametrize(("override", "field"), [
    ("serve.grpc_port=0", "serve.grpc_port"),
    ("param_server.port=0", "param_server.port"),
    ("serve.proxy_location=Disabled", "serve.proxy_location"),
    ("param_server.advertise_address=10.0.0.5:50100", "param_server.host"),
])
def test_what_cannot_work_on_a_cluster_is_refused(tmp_path: Path, override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        _yaml(tmp_path, override)


def test_a_relative_run_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="absolute"):
        build_serve_config(resolve_config(None, []), Path("runs/x"))


def test_relative_input_paths_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reward.py").write_text("def compute_score(**kw):\n    return 0.0\n")
    (tmp_path / "model").mkdir()
    _, doc = _yaml(tmp_path, "custom_reward_function.path=reward.py", "actor_rollout_ref.model.path=model",
                   "trainer.default_local_dir=ckpt")
    cfg = MeshConfig.model_validate(doc["applications"][0]["args"]["config"])
    assert cfg.custom_reward_function.path == str(tmp_path / "reward.py")
    assert cfg.actor_rollout_ref.model.path == str(tmp_path / "model")
    assert cfg.trainer.default_local_dir == str(tmp_path / "ckpt")


def test_home_relative_paths_are_expanded_for_the_replicas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`~/...` (a YAML value, or a dotted override the shell does not expand) was left as it was:
    nothing on the replicas expands it (factory.ledger_path, SQLite, the checkpoint writer), so
    each opened a directory named `~` in its own working directory, one per node."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _, doc = _yaml(tmp_path, "coordinator.ledger_path=~/ledgers/a.sqlite", "trainer.default_local_dir=~/ckpt")
    cfg = MeshConfig.model_validate(doc["applications"][0]["args"]["config"])
    assert cfg.coordinator.ledger_path == str(tmp_path / "home" / "ledgers" / "a.sqlite")
    assert cfg.trainer.default_local_dir == str(tmp_path / "home" / "ckpt")


def test_relative_tls_files_and_dist_checkpoints_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The TLS files every replica's servers and clients read (security.tls.*, an endpoint's
    ca_file) and megatron's initial dist checkpoint (which the rank actors load) are inputs the
    services read like the model path: relative, they were resolved against each replica's own
    working directory (a joined cluster's: where `ray start` ran) and the run failed there, or a
    `meshrl train --resume` from another directory read other files."""
    from meshrl.serve_config import absolute_paths

    monkeypatch.chdir(tmp_path)
    for name in ("cert.pem", "key.pem", "ca.pem", "ep_ca.pem"):
        (tmp_path / name).write_text("x")
    (tmp_path / "dist").mkdir()
    cfg = absolute_paths(resolve_config(None, [
        "security.tls.cert_file=cert.pem", "security.tls.key_file=key.pem", "security.tls.ca_file=ca.pem",
        "reward.endpoints=[{address: 'r:1', tls: true, ca_file: ep_ca.pem}]",
        "actor_rollout_ref.actor.megatron.dist_checkpointing_path=dist",
        "actor_rollout_ref.ref.megatron.dist_checkpointing_path=dist",
    ]))
    tls = cfg.security.tls
    assert (tls.cert_file, tls.key_file, tls.ca_file) == tuple(str(tmp_path / n) for n in ("cert.pem", "key.pem", "ca.pem"))
    assert cfg.reward.endpoints[0].ca_file == str(tmp_path / "ep_ca.pem")
    assert cfg.actor_rollout_ref.actor.megatron.dist_checkpointing_path == str(tmp_path / "dist")
    assert cfg.actor_rollout_ref.ref.megatron.dist_checkpointing_path == str(tmp_path / "dist")


def test_cli_prints_only_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    rc = main(["serve-config", "--run-dir", str(tmp_path / "r"), f"actor_rollout_ref.model.path={model}",
               "rollout.total_rollout_steps=64"])
    assert rc == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    ServeDeploySchema.model_validate(doc)
    assert doc["applications"][0]["args"]["config"]["rollout"]["total_rollout_steps"] == 64


def test_the_reward_handle_is_looked_up_when_first_needed_and_waits_for_the_app(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray import serve
    from ray.serve.exceptions import RayServeException

    from meshrl.v1 import reward_pb2
    from services.rollout.factory import AppHandleScorer

    class Method:
        async def remote(self, req: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
            return reward_pb2.ScoreResponse(results=[reward_pb2.ScoreResult(item_id=i.item_id, score=1.0) for i in req.items])

    class Handle:
        score_request = Method()

    lookups: list[str] = []

    def get_app_handle(name: str) -> Handle:
        lookups.append(name)
        if len(lookups) < 3:
            raise RayServeException(f"Application '{name}' does not exist.")
        return Handle()

    monkeypatch.setattr(serve, "get_app_handle", get_app_handle)
    scorer = AppHandleScorer("reward")
    assert lookups == []  # nothing at construction: the reward app may not be deployed yet
    items = [reward_pb2.ScoreItem(item_id=f"s{i}") for i in range(3)]

    async def both() -> list[Any]:
        return await asyncio.gather(scorer(items), scorer(items))

    out = asyncio.run(both())
    assert [[r.score for r in o] for o in out] == [[1.0] * 3, [1.0] * 3]
    assert lookups == ["reward"] * 3  # two refusals, then one handle shared by both callers

    monkeypatch.setattr(serve, "get_app_handle", lambda name: (_ for _ in ()).throw(RayServeException("no app")))
    with pytest.raises(RayServeException):
        asyncio.run(AppHandleScorer("reward", wait_s=0)(items))


def test_an_explicit_bytecode_cache_reaches_every_application(tmp_path: Path) -> None:
    _, doc = _yaml(tmp_path)
    assert all("PYTHONPYCACHEPREFIX" not in a["runtime_env"]["env_vars"] for a in doc["applications"])
    _, doc = _yaml(tmp_path, f"serve.bytecode_cache={tmp_path / 'pyc'}")
    for app in doc["applications"]:
        env = app["runtime_env"]["env_vars"]
        assert env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pyc") and env["PYTHONDONTWRITEBYTECODE"] == ""


def test_a_restarted_coordinator_replica_keeps_a_pending_stop(tmp_path: Path) -> None:
    """The coordinator's session comes from the YAML: a replica Serve restarts builds its core with
    the same one, so a `meshrl stop` issued before the restart still holds (each replica drew a
    new session before, and the restart cancelled the Stop). A config generated anew is a new
    session."""
    from services.coordinator.factory import build_core

    _, doc = _yaml(tmp_path)
    args = doc["applications"][0]["args"]
    assert re.fullmatch(r"[0-9a-f]{32}", args["session"]) and _yaml(tmp_path)[1]["applications"][0]["args"]["session"] != args["session"]
    cfg = MeshConfig.model_validate(args["config"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    core = build_core(cfg, str(run_dir), "", args["session"])
    core.stop()
    assert core.stopping
    core.ledger.close()
    restarted = build_core(cfg, str(run_dir), "", args["session"])
    assert restarted.stopping, "the Stop was lost when the replica restarted"
    restarted.ledger.close()
    other = build_core(cfg, str(run_dir), "", "another-session")
    assert not other.stopping, "a new session continues the run"
    other.ledger.close()



def test_every_deployment_is_what_meshrl_train_deploys(tmp_path: Path) -> None:
    """Each app's deployment options in the YAML are those of the app `meshrl train` builds from
    the same args (its `_app_builders`): serve.coordinator reaches both or neither."""
    from ray.serve.deployment import deployment_to_schema

    from meshrl.train import _app_builders

    _, doc = _yaml(tmp_path, "serve.coordinator.num_cpus=2", "serve.coordinator.resources={head: 1}")
    args = doc["applications"][0]["args"]
    for name, builder in _app_builders():
        deployed = deployment_to_schema(builder(dict(args))._bound_deployment).model_dump(mode="json", exclude_unset=True)
        written = _deployment(doc, name)
        assert deployed["ray_actor_options"] == written["ray_actor_options"], name
        assert deployed.get("max_ongoing_requests") == written.get("max_ongoing_requests"), name
        assert deployed.get("num_replicas") == written.get("num_replicas"), name


def test_meshrl_train_starts_serve_with_the_configured_proxy_location(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve.proxy_location=EveryNode (a joined cluster: every service dials 127.0.0.1 of its own
    node) reaches the Serve that `meshrl train` starts, as it reaches the serve-config YAML."""
    from meshrl.train import MeshRun
    from services.common import serve_util
    from services.trainer import ranks

    seen: dict[str, Any] = {}

    class Started(Exception):
        """Raised by the stand-in start_serve once it has seen its arguments: stops the run there."""

    def start_serve(grpc_port: int, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise Started

    monkeypatch.setattr(serve_util, "init_ray", lambda *a, **k: None)
    monkeypatch.setattr(serve_util, "start_serve", start_serve)
    monkeypatch.setattr(ranks, "spawn_for", lambda cfg, **k: None)
    cfg = resolve_config(None, ["serve.proxy_location=EveryNode", "serve.ray_address=auto"])
    with pytest.raises(Started):
        MeshRun(cfg, tmp_path, "fully_async").deploy()
    assert seen.get("proxy_location", "HeadOnly") == "EveryNode"


@pytest.mark.parametrize("overrides", [
    ["serve.rollout.num_replicas=2", "param_server.collective_receivers=3"],
    ["serve.rollout.autoscaling={min_replicas: 2, max_replicas: 2}", "param_server.collective_receivers=1"],
])
def test_collective_receivers_other_than_the_serve_rollout_replicas_are_refused(
    tmp_path: Path, overrides: list[str]
) -> None:
    # Under Serve each rollout replica is one receiver of the broadcast group
    # (services/param_server/rendezvous.py): more than the replicas and every broadcast waits for
    # ranks that never check in; fewer and a replica finds the group full and gets no weights.
    with pytest.raises(ConfigError, match=r"param_server\.collective_receivers=\d.*serve\.rollout"):
        _yaml(tmp_path, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", *overrides)
    _yaml(tmp_path, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "serve.rollout.num_replicas=2",
          "param_server.collective_receivers=2")
    # the count is the broadcast group's only: other transports ignore it
    _yaml(tmp_path, "actor_rollout_ref.rollout.checkpoint_engine.backend=grpc", *overrides)


def test_serve_rollout_gpus_other_than_the_vllm_engine_are_refused(tmp_path: Path) -> None:
    # A replica given 1 GPU for a TP=2 engine made vLLM place its second worker on a GPU outside
    # the replica's allocation (or wait for one on a full cluster).
    tp2 = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    with pytest.raises(ConfigError, match=r"serve\.rollout\.num_gpus=1 .*tensor_model_parallel_size\(2\).*"
                                          r"set serve\.rollout\.num_gpus=2"):
        _yaml(tmp_path, *tp2, "serve.rollout.num_gpus=1")
    _yaml(tmp_path, *tp2, "rollout.n_gpus_per_node=2", "serve.rollout.num_gpus=2")


def test_serve_rollout_devices_other_than_the_rollout_pool_are_refused(tmp_path: Path) -> None:
    # rollout.nnodes x rollout.n_gpus_per_node = 8 asks for 4 engines of 2 GPUs; 1 replica of 2
    # GPUs ran one, and 6 GPUs sat idle.
    tp2 = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
           "rollout.n_gpus_per_node=8", "serve.rollout.num_gpus=2"]
    with pytest.raises(ConfigError, match=r"rollout\.nnodes x rollout\.n_gpus_per_node = 8 .*serve\.rollout\.num_replicas=1 "
                                          r".*set serve\.rollout\.num_replicas=4"):
        _yaml(tmp_path, *tp2)
    _yaml(tmp_path, *tp2, "serve.rollout.num_replicas=4")


def test_gpus_reserved_for_the_trainer_replica_are_refused(tmp_path: Path) -> None:
    # The replica drives rank actors that take trainer.nnodes x trainer.n_gpus_per_node GPUs of
    # their own; GPUs given to the replica were never trained on and kept the ranks unplaced.
    with pytest.raises(ConfigError, match=r"serve\.trainer\.num_gpus=2 .*set serve\.trainer\.num_gpus=0"):
        _yaml(tmp_path, "trainer.n_gpus_per_node=2", "serve.trainer.num_gpus=2")
