"""The `mindspeed` training engine (megatron on Ascend NPU). Importing this package registers
(`megatron`, npu) and (`mindspeed`, npu); using it needs torch_npu, CANN and MindSpeed."""

# The megatron package imports MindSpeed's adaptor (on Ascend hosts) before megatron-core.
import services.trainer.engines.megatron  # noqa: F401

from .engine import MindSpeedEngine

__all__ = ["MindSpeedEngine"]
