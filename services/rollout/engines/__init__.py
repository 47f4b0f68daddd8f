"""Rollout engines: the contract (base.py), a registry with lazy imports, and the backends
(`transformers` in transformers_engine.py, `vllm` in vllm_engine.py)."""

from .base import (
    EngineHealth,
    Finish,
    GenerationRequest,
    PauseMode,
    RolloutEngine,
    SampleOutput,
    SamplingSpec,
    engine_names,
    get_engine_cls,
    register_engine,
    stop_across,
)

__all__ = [
    "EngineHealth",
    "Finish",
    "GenerationRequest",
    "PauseMode",
    "RolloutEngine",
    "SampleOutput",
    "SamplingSpec",
    "engine_names",
    "get_engine_cls",
    "register_engine",
    "stop_across",
]
