"""`meshrl serve-config`: the mesh as a config file for Ray's own `serve deploy` / `serve run`.

    meshrl serve-config CONFIG [overrides] --run-dir /shared/runs/x > serve.yaml
    serve deploy serve.yaml          # a running cluster (dashboard address), or
    serve run serve.yaml             # in the foreground (RAY_ADDRESS joins a cluster)

One application per service, as `meshrl train` deploys them (same builders, same wiring), with
their deployments' replicas and Ray resources spelled out so an operator can read and edit them:

    coordinator ── param_server ── reward ── trainer ── rollout      (all five start together)
         ▲  every service dials Serve's gRPC ingress on 127.0.0.1:<grpc_port> of its own node
         │  (proxy_location EveryNode), routed by the `application` metadata; the trainer and the
         │  rollouts retry until the coordinator answers, the rollouts' reward handle waits for
         │  the reward app, so start order does not matter.
         └─ the trainer replica places its ranks itself (a placement group of its own).

The config every app receives is the resolved MeshConfig, written once in the YAML (an anchor)
and shared by the five applications. Nothing here starts Ray.
"""

from __future__ import annotations

import copy
import os
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from services.common.auth import OPERATOR, ROLLOUT, TRAINER, env_names
from services.common.bytecode import worker_env
from services.common.config import MeshConfig
from services.common.config.param_server import discovers_address
from services.common.errors import ConfigError

from .tokens import endpoint_token_env, environment_endpoint_token_env

# Deploy order of `meshrl train`, kept in the file (Serve starts them together anyway).
APP_IMPORT_PATHS: dict[str, str] = {
    "coordinator": "services.coordinator.deployment:build_app",
    "param_server": "services.param_server.deployment:build_app",
    "reward": "services.reward.deployment:build_app",
    "trainer": "services.trainer.deployment:build_app",
    "rollout": "services.rollout.deployment:app_builder",  # build_app takes keyword extras
}
ANCHOR = "mesh"
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
_ANY = ("0.0.0.0", "::", "[::]")
# Deployment options worth showing, in this order; the rest keep the code's values.
_OPTION_ORDER = ("name", "num_replicas", "autoscaling_config", "max_ongoing_requests", "ray_actor_options",
                 "health_check_period_s", "logging_config")


def default_run_dir(cfg: MeshConfig) -> Path:
    """An absolute path under ./runs (a cluster's run directory must be on a shared filesystem)."""
    name = f"{cfg.trainer.experiment_name}-{cfg.async_training.mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    return (Path("runs") / name).resolve()


def absolute_paths(cfg: MeshConfig, base: Path | None = None) -> MeshConfig:
    """Relative paths made absolute against `base` (the cwd): replicas and rank actors run in
    other working directories, on other nodes, and a resumed run may start from another
    directory. Inputs only when they exist here (a model path may be a hub id); output
    directories always. `meshrl serve-config` and `meshrl train` both use it, so one list of
    keys (tool YAMLs and agent.args: their own validators; hf_export_dir and metrics_file: under
    the run dir)."""
    base = base or Path.cwd()
    data = cfg.model_dump(mode="json")

    def fix(value: str | None, *, must_exist: bool) -> str | None:
        if value and value.startswith("~"):
            # nothing on the replicas expands `~` (factory.ledger_path, SQLite, the checkpoint
            # writer): each opened a directory named `~` in its own working directory
            value = os.path.expanduser(value)
        if not value or Path(value).is_absolute():
            return value
        p = base / Path(value).expanduser()
        return str(p.resolve()) if p.exists() or not must_exist else value

    model = data["actor_rollout_ref"]["model"]
    model["path"] = fix(model["path"], must_exist=True)
    model["tokenizer_path"] = fix(model["tokenizer_path"], must_exist=True)
    model["lora_adapter_path"] = fix(model["lora_adapter_path"], must_exist=True)
    for key in ("train_files", "val_files"):
        data["data"][key] = [fix(f, must_exist=True) for f in data["data"][key]]
    for role in ("actor", "ref"):  # the initial weights the rank actors load
        megatron = data["actor_rollout_ref"][role]["megatron"]
        megatron["dist_checkpointing_path"] = fix(megatron["dist_checkpointing_path"], must_exist=True)
    crf = data["custom_reward_function"]
    crf["path"] = fix(crf["path"], must_exist=True)
    # TLS files: every replica's plain servers and clients read them, an endpoint's CA its dialler
    tls = data["security"]["tls"]
    for key in ("cert_file", "key_file", "client_ca_file", "ca_file", "client_cert_file", "client_key_file"):
        tls[key] = fix(tls[key], must_exist=True)
    for section in ("coordinator", "environment"):
        for key in ("tls_cert_file", "tls_key_file"):
            data[section][key] = fix(data[section][key], must_exist=True)
    for section in ("reward", "environment"):
        for ep in data[section]["endpoints"]:
            ep["ca_file"] = fix(ep["ca_file"], must_exist=True)
    trainer = data["trainer"]
    trainer["resume_from_path"] = fix(trainer["resume_from_path"], must_exist=True)
    trainer["default_local_dir"] = fix(trainer["default_local_dir"], must_exist=False)
    data["param_server"]["disk_dir"] = fix(data["param_server"]["disk_dir"], must_exist=False)
    data["coordinator"]["ledger_path"] = fix(data["coordinator"]["ledger_path"], must_exist=False)
    return MeshConfig.model_validate(data)


def check_cluster_config(cfg: MeshConfig) -> None:
    """What works under `meshrl train` on one host but not in a cluster config."""
    s, ps = cfg.serve, cfg.param_server
    if s.grpc_port == 0:
        raise ConfigError("serve.grpc_port=0: every service dials the gRPC ingress at a fixed port; set one, e.g. 9000")
    if ps.port == 0 and not discovers_address(ps):
        raise ConfigError("param_server.port=0: publishers and fetchers dial the param server's data plane at a "
                          "fixed port; set one, e.g. 50071 (or param_server.host=0.0.0.0: they ask it)")
    if ps.advertise_address and ps.host in _LOOPBACK:
        raise ConfigError(f"param_server.advertise_address={ps.advertise_address} but param_server.host={ps.host} "
                          "binds loopback only; set param_server.host=0.0.0.0")


def _proxy_location(cfg: MeshConfig) -> str:
    # The wiring dials 127.0.0.1 on every node: that needs a proxy on every node unless the
    # operator chose otherwise.
    return cfg.serve.proxy_location if "proxy_location" in cfg.serve.model_fields_set else "EveryNode"


def _logging_config() -> dict[str, Any]:
    return {"encoding": "JSON", "log_level": "INFO", "enable_access_log": False}


def _deployment_entry(app_name: str, app: Any, cfg: MeshConfig) -> dict[str, Any]:
    """The options the application's own builder set (Serve's `deployment_to_schema`: user-set
    options only), ordered for reading."""
    from ray.serve.deployment import deployment_to_schema

    schema = deployment_to_schema(app._bound_deployment)
    opts: dict[str, Any] = schema.model_dump(mode="json", exclude_unset=True)
    if app_name == "coordinator" and "ray_actor_options" not in opts:
        # serve.coordinator, should the coordinator's builder ever leave it out.
        opts["ray_actor_options"] = cfg.serve.coordinator.ray_actor_options()
    if "logging_config" in opts:
        # A deployment-level logging config hides the global one: keep its access-log choice only.
        opts["logging_config"] = {**_logging_config(), "enable_access_log": opts["logging_config"]["enable_access_log"]}
    if opts.get("autoscaling_config"):
        opts.pop("num_replicas", None)
    ordered = {k: opts[k] for k in _OPTION_ORDER if k in opts}
    return ordered | {k: v for k, v in opts.items() if k not in ordered}


def build_application(import_path: str, args: dict[str, Any]) -> Any:
    """What `serve deploy` does with an application entry (import the builder, check that it
    takes one argument, call it with `args`), without Ray."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    return call_user_app_builder_with_args_if_necessary(import_attr(import_path), args)


def build_serve_config(cfg: MeshConfig, run_dir: Path) -> dict[str, Any]:
    """The ServeDeploySchema document (a dict) for a resolved config: wired as `meshrl train`
    wires it, every application built by its own builder to read off its deployment options.
    The five applications share one `args` object (the YAML writes it once, as an anchor)."""
    from services.common.serve_util import SERVICER_FUNCTIONS

    from .plan_layout import serve_launch_problems
    from .tokens import externalize_secrets
    from .train import wire

    if not run_dir.is_absolute():
        raise ConfigError(f"--run-dir {run_dir} is relative; a cluster needs an absolute path on a shared filesystem")
    check_cluster_config(cfg)
    if problems := serve_launch_problems(cfg):  # as `meshrl train` checks them
        raise ConfigError("\n".join(problems))
    proxy_location = _proxy_location(cfg)  # before wiring, which marks every field as set
    cfg = wire(absolute_paths(cfg), cfg.serve.grpc_port)
    cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"proxy_location": proxy_location})})
    # Secrets never go into the YAML (Serve shows an application's args to whoever can read its
    # config): the apps read every token from the environment variables the comments name.
    cfg, _ = externalize_secrets(cfg)
    # session: the coordinator's, fixed here so that a replica Serve restarts keeps a pending Stop
    # (without it each replica drew a new one and a restart cancelled `meshrl stop`); a config
    # generated anew starts a new session, as a new `meshrl train` does.
    args = {"config": cfg.model_dump(mode="json"), "run_dir": str(run_dir), "session": uuid.uuid4().hex}
    apps = []
    for name, import_path in APP_IMPORT_PATHS.items():
        app = build_application(import_path, copy.deepcopy(args))
        apps.append({
            "name": name,
            "route_prefix": f"/{name}",
            "import_path": import_path,
            # serve.bytecode_cache: an explicit directory only ("auto" judges a local Ray's environment).
            "runtime_env": {"env_vars": {"MESHRL_LOG_DIR": str(run_dir / "logs"),
                                         **worker_env(cfg.serve.bytecode_cache, local_ray=False)}},
            "deployments": [_deployment_entry(name, app, cfg)],
            "args": args,
        })
    return {
        "proxy_location": proxy_location,
        "http_options": {"host": "127.0.0.1", "port": cfg.serve.http_port},
        "grpc_options": {
            "port": cfg.serve.grpc_port,
            "grpc_servicer_functions": list(SERVICER_FUNCTIONS),
            "request_timeout_s": cfg.serve.request_timeout_s,
        },
        "logging_config": _logging_config(),
        "applications": apps,
    }


class _Dumper(yaml.SafeDumper):
    """The shared args object named `&mesh` (any other shared object would get `mesh2`, ...)."""

    _anchors = 0

    def generate_anchor(self, node: Any) -> str:
        self._anchors += 1
        return ANCHOR if self._anchors == 1 else f"{ANCHOR}{self._anchors}"


def _fmt(res: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" if isinstance(v, float) else f"{k}: {v}" for k, v in res.items()) + "}"


def _replicas(dep: dict[str, Any]) -> str:
    a = dep.get("autoscaling_config")
    if a:
        return f"{a.get('min_replicas', 1)}..{a.get('max_replicas', 1)} (autoscaling)"
    return str(dep.get("num_replicas", 1))


def _actor_resources(dep: dict[str, Any]) -> dict[str, Any]:
    ray = dep.get("ray_actor_options") or {}
    res: dict[str, Any] = {"CPU": ray.get("num_cpus", 1)}
    if ray.get("num_gpus"):
        res["GPU"] = ray["num_gpus"]
    res.update(ray.get("resources") or {})
    return res


def trainer_ranks(cfg: MeshConfig) -> tuple[int, dict[str, Any], str]:
    """(world size, one rank's bundle, device) of the trainer's placement group, as
    services/trainer/workers.py asks for it."""
    from services.common.device import ray_resource

    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    device = cfg.trainer.device
    bundle: dict[str, Any] = {}
    if cfg.trainer_service.worker_num_cpus > 0:
        bundle["CPU"] = cfg.trainer_service.worker_num_cpus
    bundle.update(cfg.trainer_service.worker_resources)
    if device == "auto":
        bundle["GPU|NPU"] = 1  # answered by the cluster's resources when the replica starts
    elif ray_resource(device) is not None:
        bundle[str(ray_resource(device))] = 1
    return world, bundle, device


def _comments(doc: dict[str, Any], cfg: MeshConfig, run_dir: Path, command: str) -> dict[str, list[str]]:
    """Comment lines to put before the line that starts with each key."""
    apps = {a["name"]: a for a in doc["applications"]}
    dep = {name: a["deployments"][0] for name, a in apps.items()}
    world, bundle, device = trainer_ranks(cfg)
    grpc = doc["grpc_options"]["port"]
    ps = cfg.param_server
    ps_addr = ps.advertise_address or (f"<its node's IP>:{ps.port}" if discovers_address(ps) else f"{ps.host}:{ps.port}")
    names = env_names(cfg)
    token_envs = [names[r] for r in (ROLLOUT, TRAINER, OPERATOR)]
    token_envs += [ep.token_env or endpoint_token_env(i) for i, ep in enumerate(cfg.reward.endpoints)
                   if ep.token_env or ep.token]
    # The rollout replicas call the environment endpoints; `environment.token` is left out: it is
    # `meshrl environment serve`'s, which no application here runs.
    token_envs += [ep.token_env or environment_endpoint_token_env(i) for i, ep in enumerate(cfg.environment.endpoints)
                   if ep.token_env or ep.token]
    usage = [
        "meshrl on Ray Serve: five applications behind Serve's gRPC ingress.",
        f"Generated by: {command}",
        "Start it with Ray's own CLI, on a running cluster or in the foreground:",
        "  serve deploy serve.yaml --address http://<head>:8265",
        "  serve run serve.yaml            (RAY_ADDRESS=<head>:6379 joins a cluster)",
        f"Run directory (ledger, checkpoints, metrics, logs): {run_dir}",
        "  It must be on a filesystem every node mounts at that path; every node must import meshrl",
        "  (pip install meshrl, or this checkout on PYTHONPATH) and see actor_rollout_ref.model.path.",
        "Resources (replicas x Ray resources each):",
        *[f"  {name:<13}{_replicas(d)} x {_fmt(_actor_resources(d))}" for name, d in dep.items()],
        f"  trainer ranks {world} x {_fmt(bundle)} (placement group of the trainer replica)",
        "The apps start together: the trainer and the rollouts retry until the coordinator answers.",
        "Tokens (never in this file): every node's `ray start` environment must hold the same",
        f"  {', '.join(dict.fromkeys(token_envs))}",
        "  (e.g. `export MESHRL_ROLLOUT_TOKEN=$(openssl rand -hex 32)`; Ray workers inherit it). Without them",
        "  any client that reaches the gRPC port can call every RPC (the services warn). Operators then pass",
        f"  --token (or {names[OPERATOR]}) to meshrl status/pause/stop.",
    ]
    out: dict[str, list[str]] = {
        "proxy_location:": usage,
        "grpc_options:": [
            f"Every service dials the ingress on 127.0.0.1:{grpc} of its own node (hence a proxy on every",
            "node), routed by the `application` metadata. From outside:",
            f"  meshrl status --address <any node>:{grpc} --application coordinator",
        ],
        "- name: coordinator": ["coordinator: one stateful replica; its state is the ledger in the run directory."],
        "- name: param_server": [
            f"param_server: one replica (the store is in its memory); data plane {ps_addr}.",
        ],
        "- name: reward": ["reward: stateless replicas; the rollouts call them through a Serve handle."],
        "- name: trainer": [
            "trainer: one driver replica (the resources below, no accelerator). It places its training",
            f"ranks itself in a placement group of its own (services/trainer/workers.py): {world} bundle(s) of",
            f"{_fmt(bundle)}, strategy PACK; {world} = trainer.nnodes ({cfg.trainer.nnodes}) x "
            f"trainer.n_gpus_per_node ({cfg.trainer.n_gpus_per_node}), device trainer.device ({device}).",
            "Change the ranks in the shared config (&mesh, under the coordinator app): trainer.device,",
            "trainer.nnodes, trainer.n_gpus_per_node, trainer_service.worker_num_cpus,",
            "trainer_service.worker_resources; not here.",
        ],
        "- name: rollout": ["rollout: inference replicas (lease -> generate -> score -> submit; weights from param_server)."],
        f"  args: &{ANCHOR}": [
            "The resolved meshrl config, wired as `meshrl train` wires it; all five apps share it",
            f"(*{ANCHOR}). The `deployments:` entries above are what Serve uses for replicas and resources.",
        ],
    }
    if ps.host in _LOOPBACK:
        out["- name: param_server"] += [
            "  Loopback: one node only. For several nodes set param_server.host=0.0.0.0 (it listens on",
            "  its node's interfaces; the trainer and the rollouts ask it for its address).",
        ]
    elif discovers_address(ps):
        out["- name: param_server"] += [
            f"  Multi-node: listens on {ps.host}:{ps.port} of whichever node it lands on and advertises that",
            "  node's IP; the trainer and the rollouts ask the app for it (param_server.discover_wait_s).",
        ]
    if dep["rollout"].get("autoscaling_config"):
        out["- name: rollout"].append(
            "  Autoscaling on in-flight prompt groups (services.rollout.deployment:in_flight_policy)."
        )
    return out


def render_yaml(doc: dict[str, Any], cfg: MeshConfig, run_dir: Path, command: str) -> str:
    """The document as YAML, keys in reading order, with comments for the operator."""
    text = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120, allow_unicode=True)
    comments = _comments(doc, cfg, run_dir, command)
    lines: list[str] = []
    for line in text.splitlines():
        for key, block in comments.items():
            if line == key or line.startswith(key + " ") or (key.endswith(":") and line.startswith(key)):
                indent = line[: len(line) - len(line.lstrip())]
                lines.extend(f"{indent}# {c}" for c in block)
                break
        lines.append(line)
    return "\n".join(lines) + "\n"


def serve_config(
    config: str | None, overrides: list[str], *, run_dir: Path | None = None, mode: str | None = None,
    command: str = "meshrl serve-config",
) -> str:
    """The YAML for CONFIG (or the built-in example) plus overrides. With `model.path` null the
    built-in warm start is built (and cached) first, as `meshrl train` does."""
    from .train import ensure_model, resolve_config

    cfg = ensure_model(resolve_config(config, overrides, mode=mode))
    run_dir = (run_dir or default_run_dir(cfg)).expanduser()
    doc = build_serve_config(cfg, run_dir.resolve() if not run_dir.is_absolute() else run_dir)
    return render_yaml(doc, cfg, Path(doc["applications"][0]["args"]["run_dir"]), command)
