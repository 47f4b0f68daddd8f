"""verl-compatible tools and interactions: the base classes with verl's names and signatures, and
the loaders of verl's tool YAML and interaction YAML.

A verl tool file works here with its imports changed from

    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

to `from services.environment.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse`
(interactions: `from services.environment.tools import BaseInteraction`). The methods keep verl's
names: a tool has async `create(instance_id, **kwargs) -> (instance_id, ToolResponse)`,
`execute(instance_id, parameters, **kwargs) -> (ToolResponse | str, step_reward, metrics)`,
`calc_reward(instance_id, **kwargs) -> float`, `release(instance_id, **kwargs)`; an interaction
has `start_interaction(instance_id, **kwargs)`, `generate_response(instance_id, messages, **kwargs)
-> (should_terminate, content, turn_score, metrics)`, `calculate_score()`,
`finalize_interaction(...)`.

Tool YAML (`actor_rollout_ref.rollout.multi_turn.tool_config_path`):

    tools:
      - class_name: pkg.module.Class        # importable dotted path
        config: {type: native, ...}          # passed to the constructor as `config`
        tool_schema: {type: function, function: {name, description, parameters: <JSON schema>}}

Interaction YAML (`interaction_config_path`): `interaction:` (verl's key; `interactions:` is
accepted too) `[{name, class_name, config}]`; a prompt picks one by
`extra_info.interaction_kwargs.name`. A file that does not load fails at start with an error
naming the entry and the fix.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any
from uuid import uuid4

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.errors import ConfigError


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter (JSON schema); keys beyond verl's (items, minimum, ...) are kept."""

    model_config = ConfigDict(extra="allow")

    type: str | list[str] | None = None
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool in OpenAI's format (verl `OpenAIFunctionToolSchema`)."""

    type: str = "function"
    function: OpenAIFunctionSchema


class ToolResponse(BaseModel):
    """What a tool returns (verl `ToolResponse`); only `text` reaches a text model."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None


class BaseTool:
    """verl's tool base class (see the module docstring for the methods)."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ConfigError(f"{type(self).__name__} has no tool_schema; give one in the tool YAML")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return (instance_id or str(uuid4())), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse | str, float, dict[str, Any]]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


class BaseInteraction:
    """verl's interaction base class: a simulated user that answers assistant turns."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id or str(uuid4())

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self) -> float:
        return 0.0

    async def finalize_interaction(self, *args: Any, **kwargs: Any) -> None:
        return None


def _import_class(dotted: Any, where: str, key: str) -> type:
    if not isinstance(dotted, str) or "." not in dotted:
        raise ConfigError(f"{key}: {where}.class_name must be a dotted path 'package.module.Class', got {dotted!r}")
    module_name, _, class_name = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            f"{key}: {where}.class_name {dotted!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
            "make it importable (PYTHONPATH) or fix the path"
        ) from exc
    cls = getattr(module, class_name, None)
    if not inspect.isclass(cls):
        raise ConfigError(f"{key}: {where}.class_name {dotted!r}: module {module_name!r} has no class {class_name!r}")
    return cls


def _load_yaml(path: str, key: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{key}: {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: {path} is not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path} must be a mapping at the top level")
    return data


_TOOL_METHODS = ("create", "execute", "calc_reward", "release")


def _tool_entries(path: str, key: str) -> list[tuple[str, str, type, dict[str, Any], OpenAIFunctionToolSchema | None]]:
    """(where, class_name, class, config, YAML schema or None) of each entry of a verl tool YAML, checked."""
    data = _load_yaml(path, key)
    entries = data.get("tools")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{key}: {path} needs a non-empty list under `tools:` (verl's tool YAML)")
    out: list[tuple[str, str, type, dict[str, Any], OpenAIFunctionToolSchema | None]] = []
    for i, entry in enumerate(entries):
        where = f"tools[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{key}: {where} must be a mapping with class_name, config and tool_schema")
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown:
            raise ConfigError(f"{key}: {where} has unknown keys {sorted(unknown)}; use class_name, config, tool_schema")
        cls = _import_class(entry.get("class_name"), where, key)
        missing = [m for m in _TOOL_METHODS if not inspect.iscoroutinefunction(getattr(cls, m, None))]
        if missing:
            raise ConfigError(f"{key}: {where}.class_name {entry['class_name']!r} lacks async {missing}; "
                              "subclass services.environment.tools.BaseTool")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ConfigError(f"{key}: {where}.config must be a mapping (e.g. {{type: native}})")
        kind = config.get("type", "native")
        if kind != "native":
            raise ConfigError(f"{key}: {where}.config.type={kind!r} is not supported (MCP tools are not wired); use native")
        schema = None
        if entry.get("tool_schema") is not None:
            try:
                schema = OpenAIFunctionToolSchema.model_validate(entry["tool_schema"])
            except ValidationError as exc:
                first = exc.errors()[0]
                loc = ".".join(str(x) for x in first["loc"])
                raise ConfigError(
                    f"{key}: {where}.tool_schema.{loc}: {first['msg']}; write "
                    "{type: function, function: {name, description, parameters: {type: object, properties, required}}}"
                ) from None
        out.append((where, entry["class_name"], cls, config, schema))
    return out


def _construct(key: str, where: str, class_name: str, cls: type, config: dict[str, Any],
               schema: OpenAIFunctionToolSchema | None) -> BaseTool:
    try:
        return cls(config=config, tool_schema=schema)
    except Exception as exc:
        raise ConfigError(f"{key}: {where} ({class_name}) failed to construct: {type(exc).__name__}: {exc}") from exc


def _check_unique(key: str, where: str, name: str, names: dict[str, str]) -> None:
    if name in names:
        raise ConfigError(f"{key}: {where} is called {name!r} like {names[name]}; tool names must be unique")
    names[name] = where


def load_tools(path: str, key: str = "actor_rollout_ref.rollout.multi_turn.tool_config_path") -> list[BaseTool]:
    """The tools of a verl tool YAML, constructed (see the module docstring)."""
    tools: list[BaseTool] = []
    names: dict[str, str] = {}
    for where, class_name, cls, config, schema in _tool_entries(path, key):
        tool = _construct(key, where, class_name, cls, config, schema)
        _check_unique(key, where, tool.name, names)
        tools.append(tool)
    return tools


def tool_schemas(path: str, key: str = "actor_rollout_ref.rollout.multi_turn.tool_config_path") -> list[OpenAIFunctionToolSchema]:
    """The schemas of a verl tool YAML's tools, as load_tools' tools carry them, for processes that
    only render prompts (data.filter_overlong_prompts in the coordinator, trainer, driver, plan):
    the YAML's tool_schema where given, which BaseTool keeps as is, so a tool whose constructor
    starts a sandbox pool or opens connections is not built where no tool runs. Only an entry
    without one is constructed, its schema being the class's own (get_openai_tool_schema)."""
    out: list[OpenAIFunctionToolSchema] = []
    names: dict[str, str] = {}
    for where, class_name, cls, config, schema in _tool_entries(path, key):
        if schema is None:
            schema = _construct(key, where, class_name, cls, config, None).tool_schema
        _check_unique(key, where, schema.function.name, names)
        out.append(schema)
    return out


def load_interactions(path: str, key: str = "actor_rollout_ref.rollout.multi_turn.interaction_config_path") -> dict[str, BaseInteraction]:
    """The interactions of a verl interaction YAML by name (see the module docstring)."""
    data = _load_yaml(path, key)
    entries = data.get("interaction", data.get("interactions"))
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{key}: {path} needs a non-empty list under `interaction:` (verl's interaction YAML)")
    out: dict[str, BaseInteraction] = {}
    for i, entry in enumerate(entries):
        where = f"interaction[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{key}: {where} must be a mapping with name, class_name and config")
        cls = _import_class(entry.get("class_name"), where, key)
        if not inspect.iscoroutinefunction(getattr(cls, "generate_response", None)):
            raise ConfigError(f"{key}: {where}.class_name {entry['class_name']!r} lacks async generate_response; "
                              "subclass services.environment.tools.BaseInteraction")
        config = dict(entry.get("config") or {})
        name = entry.get("name")
        if name is None:  # verl: the class name without its "Interaction" suffix, lower-cased
            simple = str(entry["class_name"]).rsplit(".", 1)[-1]
            name = (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()
        if name in out:
            raise ConfigError(f"{key}: {where} repeats the interaction name {name!r}; names must be unique")
        config["name"] = name
        try:
            out[name] = cls(config=config)
        except Exception as exc:
            raise ConfigError(f"{key}: {where} ({entry['class_name']}) failed to construct: {type(exc).__name__}: {exc}") from exc
    return out
