"""Host memory tuning for processes that stream weights.

gRPC allocates every received message, and we allocate every encoded chunk (4 MiB by default):
glibc serves blocks that large with a fresh mmap and returns them on free, so each chunk pays its
page faults again; on a VM that costs several times the copy itself (BENCHMARKS.md). Raising the mmap threshold to its maximum (32 MiB on 64-bit) and the
trim threshold keeps such blocks on the heap, where the next chunk reuses them. Process-wide and
idempotent; a no-op off glibc. Set `param_server.tune_malloc=false` to leave malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from services.common.logging import get_logger

log = get_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
_done: bool | None = None


def tune_malloc() -> bool:
    """Apply the thresholds once per process; returns whether glibc accepted them."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    _done = ok
    log.debug("malloc_tuned", ok=ok, mmap_threshold=MMAP_THRESHOLD_BYTES, trim_threshold=TRIM_THRESHOLD_BYTES)
    return ok
