"""Ascend NPU support for the megatron engines: importing MindSpeed at the right moment, and
saying so once when it is missing.

`mindspeed.megatron_adaptor` patches megatron-core modules in place, so it must be imported
after torch and before megatron-core (services/trainer/engines/megatron/__init__.py calls
`maybe_import_mindspeed` first). On hosts without Ascend devices nothing is attempted and
nothing is logged: a GPU or CPU run never hears about MindSpeed.
"""

from __future__ import annotations

from types import ModuleType

from services.common.device import cann_home, has_ascend_devices, require_npu
from services.common.errors import MissingDependency
from services.common.logging import get_logger

log = get_logger(__name__)

_STATE: dict[str, object] = {}
INSTALL_HINT = (
    "install MindSpeed from source (github.com/Ascend/MindSpeed, the branch matching your megatron-core); "
    "the PyPI package `mindspeed` is a placeholder"
)


def maybe_import_mindspeed() -> ModuleType | None:
    """On an Ascend host with CANN: import mindspeed.megatron_adaptor (once). A missing MindSpeed
    is logged once there; anywhere else this is a silent no-op."""
    if "done" in _STATE:
        return _STATE.get("module")  # type: ignore[return-value]
    _STATE["done"] = True
    if not has_ascend_devices() or cann_home() is None:
        return None
    try:
        import mindspeed.megatron_adaptor as adaptor  # type: ignore[import-not-found]
    except ImportError as exc:
        _STATE["error"] = str(exc)
        log.warning("MindSpeed is not installed; the megatron engine cannot run on NPU", hint=INSTALL_HINT, error=str(exc))
        return None
    _STATE["module"] = adaptor
    return adaptor


def require_mindspeed() -> ModuleType:
    """mindspeed.megatron_adaptor, or MissingDependency naming torch_npu/CANN/MindSpeed."""
    require_npu("the mindspeed engine")
    adaptor = maybe_import_mindspeed()
    if adaptor is None:
        raise MissingDependency("MindSpeed", f"{INSTALL_HINT} ({_STATE.get('error', 'not importable')})")
    return adaptor
