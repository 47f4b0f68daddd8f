"""The `mindspeed` engine: the megatron engine on Ascend NPU with MindSpeed's patches applied
(repatch from override_transformer_config) before model-parallel initialisation, HCCL
collectives and NPU memory stats (both via services.common.device). Registered as
(`megatron`, npu) and (`mindspeed`, npu), like verl's MindspeedEngineWithLMHead.

Nothing here has run on NPU hardware (none exists where meshrl is developed): the patch plan and
config mapping are tested as pure functions, and construction fails fast, naming torch_npu,
CANN or MindSpeed, when one is missing.
"""

from __future__ import annotations

from typing import Any

from services.common.logging import get_logger
from services.trainer.engines.ascend import require_mindspeed
from services.trainer.engines.base import register_engine
from services.trainer.engines.megatron.engine import MegatronEngine

from .config import MindSpeedEngineConfig

log = get_logger(__name__)


@register_engine("mindspeed", "npu")
@register_engine("megatron", "npu")
class MindSpeedEngine(MegatronEngine):
    """One rank of a MindSpeed training group."""

    config_cls = MindSpeedEngineConfig

    def __init__(self, config: MindSpeedEngineConfig) -> None:  # type: ignore[override]
        if not isinstance(config, MindSpeedEngineConfig):
            config = MindSpeedEngineConfig.model_validate(config.model_dump())
        self._adaptor = require_mindspeed()  # torch_npu + CANN + MindSpeed, or a clear error
        super().__init__(config)

    def _before_model_parallel_init(self) -> None:
        plan = self.cfg.plan  # type: ignore[attr-defined]
        log.info("applying MindSpeed patches", **{k: str(v) for k, v in plan.repatch.items()})
        self._adaptor.repatch(plan.repatch)  # type: ignore[attr-defined]

    def _transformer_overrides(self, m: Any) -> dict[str, Any]:
        from .config import transformer_fields
        from .patches import build_patch_plan

        return build_patch_plan(m, transformer_fields()).transformer_overrides
