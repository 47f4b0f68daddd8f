"""The MindSpeed engine's config: the megatron engine's, plus the NPU-only parts. Pydantic runs
the parent's validators first and this class's after them (tested), so nothing the megatron
config checks is skipped on NPU."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import PrivateAttr, model_validator

from services.common.errors import ConfigError
from services.trainer.engines.megatron.config import MegatronEngineConfig

from .patches import PatchPlan, build_patch_plan


def transformer_fields() -> set[str]:
    """megatron-core's TransformerConfig field names (megatron-core must be installed)."""
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    return {f.name for f in dataclasses.fields(TransformerConfig)}


class MindSpeedEngineConfig(MegatronEngineConfig):
    """One MindSpeed (megatron on Ascend NPU) training engine."""

    device: Literal["npu"] = "npu"  # type: ignore[assignment]
    """Always `npu`."""
    _plan: PatchPlan | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _mindspeed(self) -> Self:
        if self.dtype == "float16":
            raise ConfigError("the mindspeed engine trains in bfloat16 or float32; set actor_rollout_ref.model.dtype")
        self._plan = build_patch_plan(self.megatron, transformer_fields())
        if self.ref_megatron is not None:
            build_patch_plan(self.ref_megatron, transformer_fields())  # same validation for the reference
        return self

    @property
    def plan(self) -> PatchPlan:
        assert self._plan is not None
        return self._plan

    @classmethod
    def from_spec(cls, spec: Any, **extra: Any) -> Self:
        if spec.device != "npu":
            raise ConfigError(f"the mindspeed engine runs on NPU only (device={spec.device}); use strategy=megatron there")
        return super().from_spec(spec, **extra)

    @classmethod
    def from_mesh(cls, cfg: Any, device: str = "npu", total_training_steps: int = 1, **extra: Any) -> Self:
        if device != "npu":
            raise ConfigError(f"the mindspeed engine runs on NPU only (trainer.device={device}); use strategy=megatron on {device}")
        return super().from_mesh(cfg, device, total_training_steps, **extra)
