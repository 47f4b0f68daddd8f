"""The `megatron` training engine (megatron-core). Importing this package registers
(`megatron`, cuda) and, through the MindSpeed engine, (`megatron`, npu) and (`mindspeed`, npu);
it needs `pip install meshrl[megatron]`."""

from services.trainer.engines.ascend import maybe_import_mindspeed

# MindSpeed patches megatron-core in place: on an Ascend host it must be imported first.
maybe_import_mindspeed()

from services.trainer.engines.mindspeed.engine import MindSpeedEngine  # noqa: E402

from .engine import MegatronEngine  # noqa: E402

__all__ = ["MegatronEngine", "MindSpeedEngine"]
