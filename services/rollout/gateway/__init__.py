"""The OpenAI-compatible gateway: black-box agents reach the policy over HTTP, and every call
they make becomes training data of their session (sessions.py: keys, recording, stitching;
runner.py: agents per sample, the group; app.py: the HTTP routes and server; openai_api.py: the
wire schema)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common.config import MeshConfig

from .runner import GatewayAgent, GatewayGroupFailed, GatewaySettings, Scorer
from .sessions import GatewayLimits, SessionRegistry

__all__ = ["GatewayAgent", "GatewayGroupFailed", "GatewayLimits", "GatewaySettings", "SessionRegistry", "build_gateway_agent"]


def build_gateway_agent(cfg: MeshConfig, tokenizer: Any, *, scorer: Scorer | None, max_model_len: int) -> GatewayAgent:
    """The worker's agent for agent.command / agent.endpoint; its HTTP server starts with the first group."""
    from .app import GatewayServer, build_app

    a = cfg.agent
    limits = GatewayLimits(
        max_model_len=max_model_len, response_budget=cfg.data.max_response_length,
        max_prompt_length=cfg.data.max_prompt_length, truncation=cfg.data.truncation,
        max_staleness_versions=cfg.async_training.max_staleness_versions, max_calls_per_sample=a.max_calls_per_sample,
        max_resubmits=cfg.async_training.max_resubmits,
        model_name=Path(cfg.actor_rollout_ref.model.path).name if cfg.actor_rollout_ref.model.path else "meshrl-policy",
    )
    registry = SessionRegistry(tokenizer, limits)
    agent = GatewayAgent(tokenizer, registry, GatewaySettings(
        command=tuple(a.command) if a.command else None, endpoint=a.endpoint, sample_timeout_s=a.sample_timeout_s,
        max_concurrent=a.max_concurrent, secret_env=secret_env_names(cfg),
        max_json_depth=cfg.security.limits.max_json_depth,
    ), scorer=scorer)
    server = GatewayServer(build_app(registry, max_request_bytes=a.max_request_bytes), a.host, a.port)

    async def start() -> None:
        port = await server.start()
        host = a.advertise_host or a.host
        if host in ("0.0.0.0", "::"):
            host = _node_ip()
        agent.base_url = lambda sid: f"http://{host}:{port}/sessions/{sid}/v1"

    agent.start_server = start
    agent.stop_server = server.stop
    return agent


def secret_env_names(cfg: MeshConfig) -> frozenset[str]:
    """The variables holding the mesh's secrets under names the config chose: the role tokens
    (`security.*_token_env`), the reward and environment endpoints' tokens (`token_env`), and
    `meshrl environment serve`'s token (MESHRL_ENVIRONMENT_TOKEN)."""
    from services.common.auth import env_names
    from services.environment.server import TOKEN_ENV as ENVIRONMENT_TOKEN_ENV

    endpoints = [*cfg.reward.endpoints, *cfg.environment.endpoints]
    return frozenset(env_names(cfg).values()) | {ep.token_env for ep in endpoints if ep.token_env} | {ENVIRONMENT_TOKEN_ENV}


def _node_ip() -> str:
    """This node's address as Ray knows it (what other nodes reach), else the hostname's."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    import socket

    return socket.gethostbyname(socket.gethostname())
