"""Byte code for the mesh's processes where the environment would compile it in every one.

Many container images set PYTHONDONTWRITEBYTECODE=1 and ship torch without its `__pycache__`
(pip's byte-compile skipped or stripped). Every Python process then compiles torch's and
transformers' sources anew: on the GPU host measured in BENCHMARKS.md (issue 21, fourth session of
2026-11-28) a fresh process's `import torch` + transformers' model stack took 11.2-13.3 s, and
6.7-7.0 s once the byte code was cached. A mesh starts seven or more such processes (replicas,
ranks) at once, on every run.

`serve.bytecode_cache` (`meshrl train` with a local Ray):
- "auto" (default): when torch or transformers has no byte code next to its sources and this
  environment would not write it there (writing is off, or the directory is read-only), the mesh's
  processes get `PYTHONPYCACHEPREFIX=$MESHRL_CACHE_DIR/pycache` and writing on. The processes of
  the host's first run compile what they import (those starting together may each compile a module;
  the writes are atomic), every later process and run reads it.
  Where the byte code is there, or PYTHONPYCACHEPREFIX is already set, nothing changes: a prefix
  makes Python ignore the `__pycache__` next to the sources.
- "off": the environment as it is.
- a directory: that prefix, always (a joined cluster too: the path must be writable on every node).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

PACKAGES = ("torch", "transformers")
"""The libraries whose compile dominates a replica's or rank's start-up."""


def cache_root() -> Path:
    """meshrl's cache: $MESHRL_CACHE_DIR, else ~/.cache/meshrl."""
    return Path(os.environ.get("MESHRL_CACHE_DIR", Path.home() / ".cache" / "meshrl"))


def writes_bytecode() -> bool:
    """Whether a process started from this environment writes byte code (PYTHONDONTWRITEBYTECODE
    set to anything non-empty turns it off). This interpreter's -B counts too, though Ray's workers
    do not inherit it: at worst a prefix they did not need."""
    return not (os.environ.get("PYTHONDONTWRITEBYTECODE") or sys.flags.dont_write_bytecode)


def compiled_in_place(package: str) -> bool | None:
    """Whether PACKAGE's `__init__` has its byte code next to it, or will once a process that
    writes byte code imports it; None when the package is not installed. Nothing is imported."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    # Beside the source, whatever prefix this interpreter has (cache_from_source would follow it).
    cached = Path(spec.origin).parent / "__pycache__" / Path(importlib.util.cache_from_source(spec.origin)).name
    if cached.exists():
        return True
    return writes_bytecode() and os.access(Path(spec.origin).parent, os.W_OK)


def worker_env(setting: str, *, local_ray: bool) -> dict[str, str]:
    """Environment variables for the mesh's processes under `serve.bytecode_cache` = SETTING (see
    the module docstring). An empty PYTHONDONTWRITEBYTECODE turns writing on."""
    if setting == "off":
        return {}
    if setting != "auto":
        return {"PYTHONPYCACHEPREFIX": setting, "PYTHONDONTWRITEBYTECODE": ""}  # made absolute by the config
    if not local_ray or os.environ.get("PYTHONPYCACHEPREFIX"):
        return {}
    if all(compiled_in_place(p) is not False for p in PACKAGES):
        return {}
    return {"PYTHONPYCACHEPREFIX": str(cache_root() / "pycache"), "PYTHONDONTWRITEBYTECODE": ""}
