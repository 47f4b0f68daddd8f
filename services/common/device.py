"""One place that answers: which accelerator, which collective backend, which Ray resource.

    info = detect("auto")        # DeviceInfo(kind="cuda", backend="nccl", ray_resource="GPU", count=8)
    torch_device(info, local_rank)

NPU support needs Huawei's CANN libraries and `torch_npu`; both are optional and imported only
here, lazily. A missing piece fails with a message that says what to install.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from services.common.errors import MissingDependency

DeviceKind = Literal["cuda", "npu", "cpu"]

_BACKEND: dict[str, str] = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
_RAY_RESOURCE: dict[str, str | None] = {"cuda": "GPU", "npu": "NPU", "cpu": None}
_VISIBLE_ENV: dict[str, str | None] = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "npu": "ASCEND_RT_VISIBLE_DEVICES",
    "cpu": None,
}


@dataclass(frozen=True)
class DeviceInfo:
    kind: DeviceKind
    """Torch device type."""
    backend: str
    """torch.distributed backend for collectives on this device."""
    ray_resource: str | None
    """Ray resource name that schedules this device (None for CPU)."""
    count: int
    """Devices visible to this process."""

    @property
    def visible_devices_env(self) -> str | None:
        """Environment variable that restricts visible devices (None for CPU)."""
        return _VISIBLE_ENV[self.kind]


def collective_backend(kind: str) -> str:
    """nccl / hccl / gloo for cuda / npu / cpu."""
    try:
        return _BACKEND[kind]
    except KeyError:
        raise ValueError(f"unknown device kind {kind!r}; use cuda, npu or cpu") from None


def backend_device_kind(backend: str) -> DeviceKind:
    """cuda / npu / cpu for nccl / hccl / gloo (the inverse of `collective_backend`)."""
    for kind, name in _BACKEND.items():
        if name == backend:
            return kind  # type: ignore[return-value]
    raise ValueError(f"unknown collective backend {backend!r}; use nccl (CUDA), hccl (Ascend) or gloo (CPU)")


def ray_resource(kind: str) -> str | None:
    """GPU / NPU / None for cuda / npu / cpu."""
    if kind not in _RAY_RESOURCE:
        raise ValueError(f"unknown device kind {kind!r}; use cuda, npu or cpu")
    return _RAY_RESOURCE[kind]


def import_torch_npu() -> object:
    """Import torch_npu or fail with what to install. Call only on NPU paths. Its import fails
    with ImportError (libhccl.so, libascendcl.so ...) when CANN is absent, and a broken torch_npu
    can also raise RuntimeError/OSError at import; all are reported as MissingDependency."""
    try:
        import torch_npu  # type: ignore[import-not-found]
    except (ImportError, OSError, RuntimeError) as exc:
        raise MissingDependency(
            "torch_npu (Ascend NPU support)",
            "install Huawei CANN and `pip install meshrl[npu]` (torch_npu matching your torch); "
            f"import failed with: {exc}",
        ) from exc
    return torch_npu


# Where CANN is looked for (set by Ascend's set_env.sh); torch_npu's import fails without it.
_CANN_ENV = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_OPP_PATH")
def has_ascend_devices() -> bool:
    """True when the host exposes Ascend device nodes (/dev/davinci<N>); imports nothing."""
    return any(name.startswith("davinci") and name[7:].isdigit() for name in _safe_listdir("/dev"))


def cann_home() -> str | None:
    """The CANN toolkit directory from Ascend's environment variables, if set and present."""
    for var in _CANN_ENV:
        path = os.environ.get(var)
        if path and os.path.isdir(path):
            return path
    return None


def require_npu(what: str = "this NPU path") -> object:
    """Fail fast, naming the missing piece, unless CANN and torch_npu are both usable. Returns
    the torch_npu module. Call at the top of every NPU-only code path."""
    if cann_home() is None:
        raise MissingDependency(
            f"Huawei CANN (needed by {what})",
            "install the CANN toolkit and `source <cann>/set_env.sh` so ASCEND_TOOLKIT_HOME is set; "
            "NPU paths cannot run on this host",
        )
    return import_torch_npu()


def ray_actor_resources(kind: str, count: float) -> dict[str, object]:
    """Ray actor / Serve `ray_actor_options` for `count` devices: num_gpus for CUDA, the custom
    `NPU` resource for Ascend (Ray's NPUAcceleratorManager), nothing for CPU."""
    if kind == "cuda":
        return {"num_gpus": count}
    if kind == "npu":
        return {"resources": {"NPU": count}}
    if kind == "cpu":
        return {}
    raise ValueError(f"unknown device kind {kind!r}; use cuda, npu or cpu")


_COLLECTIVE_ENV: dict[str, dict[str, str]] = {
    # HCCL's connect timeout (s) defaults to 120: ranks of a large job that reach their first
    # collective minutes apart (model loading, a checkpoint read) would fail it.
    "hccl": {"HCCL_CONNECT_TIMEOUT": "600"},
}


def apply_collective_env(backend: str) -> None:
    """Set the environment `backend`'s communicators read when they are created (a value the
    operator set stays); call it before creating a process group."""
    for key, value in _COLLECTIVE_ENV.get(backend, {}).items():
        os.environ.setdefault(key, value)


def _npu_count() -> int:
    # Avoid importing torch_npu when no Ascend device node exists: its import fails without CANN.
    if not has_ascend_devices():
        return 0
    try:
        import_torch_npu()
        import torch

        return int(torch.npu.device_count())  # type: ignore[attr-defined]
    except (MissingDependency, RuntimeError):
        return 0


def _safe_listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def detect(prefer: str = "auto") -> DeviceInfo:
    """The device this process should use. `prefer` is cuda, npu, cpu or auto (cuda > npu > cpu).
    Asking for an accelerator that is absent is an error, never a silent CPU fallback."""
    import torch

    if prefer not in ("auto", "cuda", "npu", "cpu"):
        raise ValueError(f"unknown device {prefer!r}; use auto, cuda, npu or cpu")
    if prefer in ("auto", "cuda") and torch.cuda.is_available():
        return DeviceInfo("cuda", "nccl", "GPU", torch.cuda.device_count())
    if prefer == "cuda":
        raise MissingDependency("CUDA device", "no CUDA device is visible; set trainer.device=cpu or run on a GPU node")
    if prefer in ("auto", "npu"):
        n = _npu_count()
        if n > 0:
            return DeviceInfo("npu", "hccl", "NPU", n)
        if prefer == "npu":
            import_torch_npu()  # raises with the install hint when that is the reason
            raise MissingDependency("Ascend NPU", "no NPU device is visible (check ASCEND_RT_VISIBLE_DEVICES)")
    return DeviceInfo("cpu", "gloo", None, 1)


def torch_device(info: DeviceInfo, local_rank: int = 0) -> str:
    """Torch device string for a local rank."""
    return "cpu" if info.kind == "cpu" else f"{info.kind}:{local_rank}"


def memory_stats(info: DeviceInfo, local_rank: int = 0) -> dict[str, float]:
    """Allocated / reserved / total bytes on the device (process RSS on CPU)."""
    import torch

    if info.kind == "cuda":
        free, total = torch.cuda.mem_get_info(local_rank)
        return {
            "allocated_bytes": float(torch.cuda.memory_allocated(local_rank)),
            "reserved_bytes": float(torch.cuda.memory_reserved(local_rank)),
            "free_bytes": float(free),
            "total_bytes": float(total),
        }
    if info.kind == "npu":
        npu = torch.npu  # type: ignore[attr-defined]
        free, total = npu.mem_get_info(local_rank)
        return {
            "allocated_bytes": float(npu.memory_allocated(local_rank)),
            "reserved_bytes": float(npu.memory_reserved(local_rank)),
            "free_bytes": float(free),
            "total_bytes": float(total),
        }
    import resource

    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"max_rss_bytes": float(rss_kb) * 1024.0}
