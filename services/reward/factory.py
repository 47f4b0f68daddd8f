"""Build the reward pipeline (and its servicer) from a MeshConfig."""

from __future__ import annotations

from services.common.config import MeshConfig

from .core import RemoteRoute, RewardPipeline
from .custom import load_custom_function
from .endpoints import EndpointClient
from .pool import BlockingPool
from .procpool import ProcessPool
from .shaping import OverlongShaping, Stage


def build_stages(cfg: MeshConfig) -> list[Stage]:
    """Shaping stages in order: DAPO's overlong buffer when `reward_model.overlong_buffer.enable`."""
    stages: list[Stage] = []
    ob = cfg.reward_model.overlong_buffer
    if ob.enable:
        stages.append(
            OverlongShaping(
                buffer_len=ob.len, penalty_factor=ob.penalty_factor,
                default_max_length=cfg.data.max_response_length, log=ob.log,
            )
        )
    return stages


def build_pipeline(cfg: MeshConfig) -> RewardPipeline:
    """The scoring pipeline a config describes: built-ins, the custom function, endpoints, stages.
    Raises ConfigError when the custom function cannot be loaded."""
    crf = cfg.custom_reward_function
    batched = cfg.reward_model.reward_manager == "batch"
    custom = load_custom_function(crf.path, crf.name, crf.reward_kwargs, batched=batched) if crf.path else None
    remotes = [
        RemoteRoute(EndpointClient(ep, index=i), frozenset(ep.data_sources)) for i, ep in enumerate(cfg.reward.endpoints)
    ]
    return RewardPipeline(
        custom=custom,
        remotes=remotes,
        stages=build_stages(cfg),
        pool=BlockingPool(cfg.reward.num_workers),
        process_pool=ProcessPool(cfg.reward.num_workers) if cfg.reward.scorer_processes else None,
        item_timeout_s=cfg.reward.item_timeout_s,
        max_abandoned_threads=cfg.reward.max_abandoned_threads,
    )
