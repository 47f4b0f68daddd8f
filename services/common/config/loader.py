"""Load a MeshConfig from YAML plus dotted overrides, with errors that name the key and the fix."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from services.common.errors import ConfigError

from .resolve import LOOP_SECTION, legacy_keys_in
from .root import MeshConfig


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value). The value is parsed as YAML (numbers, bools,
    lists, null); a `+` prefix (Hydra's "add key") is accepted and ignored."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not KEY=VALUE; write e.g. async_training.staleness_threshold=0.5")
    key, _, raw = text.partition("=")
    key = key.strip().lstrip("+")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML ({exc})") from exc
    return key.split("."), value


def _known_keys(model: type[BaseModel], path: list[str]) -> list[str]:
    """Field names available at `path` inside `model` (for "did you mean")."""
    current: type[BaseModel] | None = model
    for part in path:
        if current is None or part not in current.model_fields:
            return []
        annotation = current.model_fields[part].annotation
        current = _model_of(annotation)
    return list(current.model_fields) if current is not None else []


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _wants_text(model: type[BaseModel], path: list[str]) -> bool:
    """Whether the field at `path` inside `model` is a string (`str` or `str | None`)."""
    current: type[BaseModel] | None = model
    for part in path[:-1]:
        if current is None or part not in current.model_fields:
            return False
        current = _model_of(current.model_fields[part].annotation)
    if current is None or path[-1] not in current.model_fields:
        return False
    annotation = current.model_fields[path[-1]].annotation
    kinds = set(getattr(annotation, "__args__", None) or ()) if annotation is not str else {str}
    return str in kinds and kinds <= {str, type(None)}


def apply_override(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = {}
            node[part] = child
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part} is a value, not a section")
        node = child
    node[path[-1]] = value


def format_validation_error(
    exc: ValidationError, model: type[BaseModel] = MeshConfig, written_as: dict[str, str] | None = None
) -> str:
    """One line per error, naming the key (`written_as`: {key: the old spelling the input used})."""
    written_as = written_as or {}
    lines = []
    errors = exc.errors()
    derived = [e for e in errors if ".".join(map(str, e["loc"])).startswith(LOOP_SECTION + ".")]
    if len(derived) < len(errors):
        # trainer_service.loop holds copies of verl keys: its errors repeat those keys' own.
        errors = [e for e in errors if e not in derived]
    for err in errors:
        loc = [str(p) for p in err["loc"] if not isinstance(p, int)]
        # pydantic puts union member names into loc (e.g. "SyntheticTaskConfig"); drop them.
        loc = [p for p in loc if not p[:1].isupper()]
        key = ".".join(loc) or "<root>"
        if key in written_as:
            key = f"{key} (written as {written_as[key]})"
        if err["type"] == "extra_forbidden":
            parent, leaf = loc[:-1], loc[-1] if loc else ""
            known = _known_keys(model, parent)
            close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
            hint = f"; did you mean {'.'.join([*parent, close[0]])}?" if close else ""
            lines.append(f"{key}: unknown key{hint} (known here: {', '.join(sorted(known)) or 'none'})")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
            lines.append(f"{key}: {msg}{shown}" if loc else f"{msg}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None) -> MeshConfig:
    """Read YAML (or nothing: all defaults), apply dotted overrides, validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        tree = loaded
    for text in overrides or []:
        keys, value = parse_override(text)
        if value is not None and not isinstance(value, (str, bool, list, dict)) and _wants_text(MeshConfig, keys):
            # A string key keeps the text as written: YAML 1.1 would turn it into a number (octal,
            # sexagesimal, underscores dropped) or a date. Bools stay: a key such as
            # serve.bytecode_cache reads an unquoted on / off itself.
            value = text.partition("=")[2].strip()
        apply_override(tree, keys, value)
    try:
        return MeshConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, written_as=legacy_keys_in(tree))) from None


def dump_config(cfg: MeshConfig) -> str:
    """The resolved config as YAML (every key, defaults included; not `trainer_service.loop`,
    which is derived from verl's keys again when the YAML is loaded)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def write_resolved_config(cfg: MeshConfig, run_dir: str | os.PathLike[str]) -> Path:
    """Write `<run_dir>/config.resolved.yaml`; every run does this before it starts."""
    out = Path(run_dir) / "config.resolved.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_config(cfg))
    return out
