"""Build environments from a MeshConfig: the in-process tool environment, the remote ones, and
the router that picks one per prompt by data_source (see EnvironmentConfig's docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.common.config import MeshConfig

from .base import Environment
from .client import RemoteEnvironment
from .tool_env import ToolEnvironment
from .tools import load_interactions, load_tools, tool_schemas


def tool_environment(cfg: MeshConfig) -> ToolEnvironment:
    """The verl tools and interactions of `actor_rollout_ref.rollout.multi_turn` (none: an
    environment that ends every episode after the first assistant turn). Raises ConfigError naming
    the entry when a YAML does not load."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    tools = load_tools(mt.tool_config_path) if mt.tool_config_path else []
    interactions = load_interactions(mt.interaction_config_path) if mt.interaction_config_path else {}
    return ToolEnvironment(tools, interactions, max_parallel_calls=mt.max_parallel_calls, call_timeout_s=mt.tool_timeout_s)


def prompt_tools(cfg: MeshConfig) -> Callable[[str], tuple[dict[str, Any], ...]] | None:
    """data_source -> the tool schemas the agent loop renders into that prompt (those the router
    sends to the in-process tool environment; () for none), for data.filter_overlong_prompts; None
    when the agent loop renders no prompt (no multi-turn, the gateway's agent, or the filter is
    off: nothing is loaded). Multi-turn without tools still gives (): the agent loop renders a
    text prompt as a user message through the chat template, counted as raw text it was short."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not (cfg.data.filter_overlong_prompts and mt.enable) or cfg.agent.enabled:
        return None
    # read from the YAML, not by constructing the tools: this runs where no tool does (see tool_schemas)
    schemas = (tuple(s.model_dump(exclude_none=True) for s in tool_schemas(mt.tool_config_path))
               if mt.tool_config_path else ())
    remote = {ds for ep in cfg.environment.endpoints for ds in ep.data_sources}
    return lambda data_source: () if data_source in remote else schemas


class EnvironmentRouter:
    """data_source -> Environment: an endpoint that lists it, else the in-process tool
    environment when it has tools or interactions, else the catch-all endpoint, else the tool
    environment (which ends the episode when the policy calls nothing)."""

    def __init__(self, local: Environment, remotes: list[tuple[Environment, frozenset[str]]]) -> None:
        self.local = local
        self.remotes = remotes
        self._by_source = {ds: env for env, sources in remotes for ds in sources}
        self._catch_all = next((env for env, sources in remotes if not sources), None)
        self._local_has_tools = not isinstance(local, ToolEnvironment) or bool(local.tools or local.interactions)

    def route(self, data_source: str) -> Environment:
        env = self._by_source.get(data_source)
        if env is not None:
            return env
        if self._local_has_tools or self._catch_all is None:
            return self.local
        return self._catch_all

    def environments(self) -> list[Environment]:
        return [self.local, *(env for env, _ in self.remotes)]

    async def aclose(self) -> None:
        for env in self.environments():
            await env.aclose()

    def status(self) -> list[dict[str, Any]]:
        return [env.status() for env in self.environments()]


def build_router(cfg: MeshConfig) -> EnvironmentRouter:
    remotes: list[tuple[Environment, frozenset[str]]] = [
        (RemoteEnvironment(ep, index=i), frozenset(ep.data_sources)) for i, ep in enumerate(cfg.environment.endpoints)
    ]
    return EnvironmentRouter(tool_environment(cfg), remotes)
