"""`meshrl plan`: derived quantities and the resource layout of a config, without starting
anything. Invalid configs fail here with the same messages as at run start."""

from __future__ import annotations

from typing import Any

from services.common.config import MeshConfig, derive, load_config
from services.common.data import train_dataset


def resource_layout(cfg: MeshConfig) -> dict[str, Any]:
    """Devices per role, as the config asks for them."""
    trainer_devices = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    rollout_devices = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    r = cfg.actor_rollout_ref.rollout
    per_engine = r.tensor_model_parallel_size * r.data_parallel_size
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
        },
    }


def make_plan(config: str | None, overrides: list[str]) -> dict[str, Any]:
    cfg = load_config(config, overrides)
    dataset_size: int | None
    try:
        dataset_size = len(train_dataset(cfg.data))
    except Exception:  # noqa: BLE001 -- plan must work without the data files present
        dataset_size = None
    derived = derive(cfg, dataset_size=dataset_size)
    return {
        "derived": {**derived.as_dict(), "dataset_size": dataset_size},
        "async_training": cfg.async_training.model_dump(mode="json"),
        "layout": resource_layout(cfg),
    }
