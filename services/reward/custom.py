"""Load a verl-style custom reward function: `custom_reward_function.{path,name}`.

`path` is a .py file (loaded under a private module name, its directory put on sys.path so it can
import its siblings, like a script) or an importable module ("my_pkg.rewards"). The function has
verl's signature `compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)` and
returns a number or a dict with `score`; it may be `async def`. `reward_kwargs` are passed on
every call (verl binds them the same way).

With `reward_model.reward_manager: batch` the function has verl's batch signature instead,
`compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)` returning one
result per item, and is called once per scored batch.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from services.common.errors import ConfigError

from .procpool import FunctionSpec


@dataclass(frozen=True)
class CustomFunction:
    """A loaded custom reward function."""

    name: str
    """"path:name", for logs and errors."""
    fn: Callable[..., Any]
    is_async: bool
    batched: bool = False
    """verl's batch signature (lists in, a list out)."""
    source: FunctionSpec | None = None
    """How a scorer process loads the same function (services/reward/procpool.py)."""


def _looks_like_file(path: str) -> bool:
    return path.endswith(".py") or "/" in path or "\\" in path


def _load_file(path: str) -> ModuleType:
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise ConfigError(
            f"custom_reward_function.path={path!r}: no such file; give a .py file or an importable module name"
        )
    module_name = "meshrl_custom_reward_" + hashlib.sha1(str(p).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, p)
    if spec is None or spec.loader is None:
        raise ConfigError(f"custom_reward_function.path={path!r}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    if str(p.parent) not in sys.path:
        sys.path.append(str(p.parent))
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # user code: report where it came from, then re-raise
        del sys.modules[module_name]
        raise ConfigError(f"custom_reward_function.path={path!r} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def _load_module(path: str) -> ModuleType:
    try:
        return importlib.import_module(path)
    except ImportError as exc:
        raise ConfigError(
            f"custom_reward_function.path={path!r} is not an importable module ({exc}); give a .py file path or "
            "install the package"
        ) from exc


def load_custom_function(
    path: str, name: str = "compute_score", reward_kwargs: Mapping[str, Any] | None = None, *, batched: bool = False
) -> CustomFunction:
    """Load `name` from `path` (see module docstring). Raises ConfigError naming the key to fix."""
    module = _load_file(path) if _looks_like_file(path) else _load_module(path)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise ConfigError(
            f"custom_reward_function.name={name!r}: {path} has no function of that name; functions there: {found}"
        )
    is_async = inspect.iscoroutinefunction(fn)
    if reward_kwargs:
        fn = functools.partial(fn, **dict(reward_kwargs))
    return CustomFunction(name=f"{path}:{name}", fn=fn, is_async=is_async, batched=batched,
                          source=FunctionSpec.custom(path, name, reward_kwargs, batched=batched))
