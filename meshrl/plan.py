"""`meshrl plan`: derived quantities, the parallel layout, per-rank memory estimates and the
checks of a config, without starting anything or touching a device. Invalid configs fail here
with one message that lists every problem and its fix.

Model facts come from `model.path` (a local directory with config.json), else from the table of
known configs in services/common/model_arch.py (there is no model hub), else the built-in tiny
model when `model.path` is null.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common.config import MeshConfig, derive, load_config
from services.common.data import train_dataset
from services.common.errors import ConfigError
from services.common.model_arch import ModelArch, load_arch

from .plan_layout import (
    megatron_layout,
    memory_estimate,
    rollout_checks,
    rollout_engine_devices,
    rollout_expert_parallel,
    rollout_parallel,
    serve_launch_problems,
    trainer_checks,
)

RECIPES_DIR = Path(__file__).resolve().parent.parent / "configs" / "recipes"


def resolve_config_path(config: str | None) -> str:
    """A path, or a recipe name from configs/recipes (with or without .yaml); none: the built-in
    example, which `meshrl train` runs without a CONFIG (the bare defaults are no runnable plan:
    100 prompts against 1024 a version, so 0 versions)."""
    if config is None:
        from .train import EXAMPLE_CONFIG

        return str(EXAMPLE_CONFIG)
    if Path(config).exists():
        return config
    for candidate in (RECIPES_DIR / config, RECIPES_DIR / f"{config}.yaml"):
        if candidate.is_file():
            return str(candidate)
    return config


def model_arch(cfg: MeshConfig) -> tuple[ModelArch, str]:
    path = cfg.actor_rollout_ref.model.path
    if path is None:
        from services.common.tiny import TINY_CONFIGS, build_tokenizer

        vocab = len(build_tokenizer())
        return ModelArch.from_hf_config({"model_type": "qwen3", "vocab_size": vocab, **TINY_CONFIGS["qwen3"]}), "built-in tiny"
    source = "config.json" if Path(path, "config.json").is_file() else "known-config table"
    return load_arch(path), source


def resource_layout(cfg: MeshConfig) -> dict[str, Any]:
    """Devices per role, as the config asks for them."""
    trainer_devices = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    rollout_devices = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    r = cfg.actor_rollout_ref.rollout
    sizes = rollout_parallel(cfg)  # engine_kwargs.vllm's sizes are the ones vLLM runs
    per_engine = rollout_engine_devices(cfg)
    app = cfg.serve.rollout
    return {
        "device": cfg.trainer.device,
        "trainer": {
            "nnodes": cfg.trainer.nnodes,
            "devices_per_node": cfg.trainer.n_gpus_per_node,
            "world_size": trainer_devices,
            "engine": cfg.actor_rollout_ref.actor.strategy,
        },
        "rollout": {
            "nnodes": cfg.rollout.nnodes,
            "devices_per_node": cfg.rollout.n_gpus_per_node,
            "devices": rollout_devices,
            "engine": r.name,
            "devices_per_engine": per_engine,
            "engines": max(1, rollout_devices // per_engine),
            "tensor_parallel": sizes["tp"][1],
            "data_parallel": sizes["dp"][1],
            "pipeline_parallel": sizes["pp"][1],
            "expert_parallel": rollout_expert_parallel(cfg)[1],  # TP x DP when on: vLLM has no EP size
            # what runs under Serve (filled from the above when not given: resolve.py _serve_rollout_sizing);
            # with autoscaling, the most replicas; 0 devices: none reserved
            "serve_replicas": app.num_replicas if app.autoscaling is None else app.autoscaling.max_replicas,
            "devices_per_replica": app.num_gpus or float(app.resources.get("NPU", 0)),
        },
    }


def make_plan(config: str | None, overrides: list[str], link_gbps: float | None = None,
              changed_fraction: float | None = None) -> dict[str, Any]:
    """The plan of a config; with `link_gbps`, also the weight-sync estimate (plan_sync.py;
    `changed_fraction`: the share of elements a version changes, for its delta-sync case)."""
    cfg = load_config(resolve_config_path(config), overrides)
    dataset_size: int | None
    try:
        from services.environment.factory import prompt_tools

        dataset_size = len(train_dataset(cfg.data, cfg.actor_rollout_ref.model, prompt_tools(cfg)))
    except Exception:  # noqa: BLE001 -- plan must work without the data files present
        dataset_size = None
    derived = derive(cfg, dataset_size=dataset_size)
    arch, source = model_arch(cfg)
    errors: list[str] = []
    warnings: list[str] = []
    layout = resource_layout(cfg)
    strategy = cfg.actor_rollout_ref.actor.strategy
    trainer_checks(cfg, arch, errors, warnings)
    rollout_checks(cfg, arch, errors, warnings)
    errors.extend(serve_launch_problems(cfg))
    if strategy in ("megatron", "mindspeed"):
        layout["trainer"]["megatron"] = megatron_layout(cfg, arch, errors)
    if errors:
        raise ConfigError("the plan is not runnable:\n  - " + "\n  - ".join(errors))
    counts = arch.param_counts()
    extra: dict[str, Any] = {}
    if link_gbps is not None:
        from .plan_sync import DELTA_CHANGED_FRACTION, weight_sync_estimate

        extra["weight_sync"] = weight_sync_estimate(
            cfg, arch, link_gbps,
            changed_fraction=DELTA_CHANGED_FRACTION if changed_fraction is None else changed_fraction)
    return {
        "derived": {**derived.as_dict(), "dataset_size": dataset_size},
        "async_training": cfg.async_training.model_dump(mode="json"),
        "model": {
            "source": source,
            "verified": arch.verified,
            "model_type": arch.model_type,
            "layers": arch.num_layers,
            "hidden_size": arch.hidden_size,
            "attention_heads": arch.num_attention_heads,
            "kv_heads": arch.num_key_value_heads,
            "experts": arch.num_experts,
            "experts_per_token": arch.num_experts_per_tok,
            "linear_attention_layers": arch.num_linear_attention_layers,
            "vocab_size": arch.vocab_size,
            "params": arch.total_params,
            "params_by_kind": counts,
        },
        "layout": layout,
        "memory": memory_estimate(cfg, arch),
        **extra,
        "warnings": warnings,
    }
