"""Environments are third-party code: an environment endpoint gets only the token its config
names, never the mesh's rollout token by default, and an environment's tokens stay out of every
file meshrl writes (config.resolved.yaml, serve-config YAML) and out of agent processes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import grpc.aio
import pytest

from meshrl.tokens import environment_endpoint_token_env, prepare_run_secrets
from meshrl.v1 import environment_pb2
from services.common.config import MeshConfig, load_config, write_resolved_config
from services.common.errors import Unauthenticated
from services.common.security import use_role
from services.environment.base import EnvPrompt
from services.environment.client import RemoteEnvironment
from services.environment.config import EnvironmentEndpointConfig
from services.environment.factory import tool_environment
from services.environment.server import TOKEN_ENV, EnvironmentServer

ROLLOUT_SECRET = "MESH-ROLLOUT-SECRET"
ROLE_TOKENS = {"MESHRL_ROLLOUT_TOKEN": ROLLOUT_SECRET, "MESHRL_TRAINER_TOKEN": "TRAINER-SECRET",
               "MESHRL_OPERATOR_TOKEN": "OPERATOR-SECRET"}
ENV_OVERRIDES = [
    'environment.endpoints=[{"address": "127.0.0.1:1", "name": "sandbox", "data_sources": ["a"], '
    '"token": "ENV-ENDPOINT-SECRET"}, {"address": "127.0.0.1:2", "name": "own", "token": "OWN-ENV-SECRET", '
    '"token_env": "SANDBOX_KEY"}]',
    "environment.token=ENV-SERVE-SECRET",
]
SECRETS = ("ENV-ENDPOINT-SECRET", "OWN-ENV-SECRET", "ENV-SERVE-SECRET")
PROMPT = EnvPrompt(prompt_id="p", data_source="a", messages=(), ground_truth="")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*ROLE_TOKENS, "MESHRL_TOKEN", TOKEN_ENV, "SANDBOX_KEY", environment_endpoint_token_env(0)]:
        monkeypatch.delenv(name, raising=False)


# ---- what an environment endpoint is sent ------------------------------------------------------


async def _authorization_seen(cfg: EnvironmentEndpointConfig) -> list[str]:
    """The `authorization` values a bare EnvironmentService on loopback receives on one Start."""
    seen: list[str] = []

    async def start(request: environment_pb2.StartRequest, context: grpc.aio.ServicerContext) -> environment_pb2.StartResponse:
        seen.extend(m.value for m in context.invocation_metadata() or () if m.key == "authorization")
        return environment_pb2.StartResponse(session_id=request.session_id)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("meshrl.v1.EnvironmentService", {
        "Start": grpc.unary_unary_rpc_method_handler(
            start, request_deserializer=environment_pb2.StartRequest.FromString,
            response_serializer=environment_pb2.StartResponse.SerializeToString),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    env = RemoteEnvironment(cfg.model_copy(update={"address": f"127.0.0.1:{port}"}))
    try:
        await env.start("L0/0", PROMPT)
    finally:
        await env.aclose()
        await server.stop(0)
    return seen


def _as_rollout_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ROLE_TOKENS.items():
        monkeypatch.setenv(name, value)
    use_role(load_config(None, []), "rollout")  # what a rollout replica does when it starts


def test_an_endpoint_without_a_token_of_its_own_is_sent_none(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rollout_replica(monkeypatch)
    seen = asyncio.run(_authorization_seen(EnvironmentEndpointConfig(address="127.0.0.1:1", max_retries=0)))
    assert seen == []


@pytest.mark.parametrize(("update", "expected"), [
    ({"token": "ENDPOINT-KEY"}, "Bearer ENDPOINT-KEY"),
    ({"token_env": "SANDBOX_KEY"}, "Bearer SANDBOX-KEY"),
    # the opt-in for a `meshrl environment serve` on the mesh's tokens
    ({"token_env": "MESHRL_ROLLOUT_TOKEN"}, f"Bearer {ROLLOUT_SECRET}"),
])
def test_an_endpoint_is_sent_exactly_the_token_its_config_names(
    monkeypatch: pytest.MonkeyPatch, update: dict[str, str], expected: str
) -> None:
    _as_rollout_replica(monkeypatch)
    monkeypatch.setenv("SANDBOX_KEY", "SANDBOX-KEY")
    cfg = EnvironmentEndpointConfig(address="127.0.0.1:1", max_retries=0, **update)
    assert asyncio.run(_authorization_seen(cfg)) == [expected]


def test_environment_serve_on_the_mesh_tokens_takes_the_rollout_token_only_when_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`meshrl environment serve` without a token of its own checks the mesh's role tokens: an
    endpoint reaches it with `token_env: MESHRL_ROLLOUT_TOKEN`, and is refused without it."""
    _as_rollout_replica(monkeypatch)

    async def go() -> None:
        cfg = load_config(None, [])
        server = EnvironmentServer(tool_environment(cfg), cfg.environment, port=0)
        await server.start()
        named = RemoteEnvironment(EnvironmentEndpointConfig(address=server.address, token_env="MESHRL_ROLLOUT_TOKEN"))
        bare = RemoteEnvironment(EnvironmentEndpointConfig(address=server.address, name="bare", max_retries=0))
        try:
            await named.start("L0/0", PROMPT)
            with pytest.raises(Unauthenticated, match="environment endpoint 'bare'"):
                await bare.start("L0/1", PROMPT)
        finally:
            for env in (named, bare):
                await env.aclose()
            await server.stop()

    asyncio.run(go())


# ---- an environment's tokens in files and agent processes -------------------------------------


def test_the_resolved_config_holds_no_environment_token(tmp_path: Path) -> None:
    cfg = load_config(None, ENV_OVERRIDES)
    clean, env, restore = prepare_run_secrets(cfg, tmp_path)
    try:
        text = write_resolved_config(clean, tmp_path).read_text()
        for secret in SECRETS:
            assert secret not in text
        # ... and whoever needs them gets them through the environment.
        assert env[environment_endpoint_token_env(0)] == os.environ[environment_endpoint_token_env(0)] == "ENV-ENDPOINT-SECRET"
        assert env["SANDBOX_KEY"] == "OWN-ENV-SECRET"  # an endpoint's own variable name is kept
        assert env[TOKEN_ENV] == "ENV-SERVE-SECRET"  # where `meshrl environment serve` looks
        endpoints = clean.environment.endpoints
        assert [ep.token for ep in endpoints] == [None, None] and clean.environment.token is None
        assert [ep.token_env for ep in endpoints] == [environment_endpoint_token_env(0), "SANDBOX_KEY"]
    finally:
        restore()
    assert environment_endpoint_token_env(0) not in os.environ and TOKEN_ENV not in os.environ


def test_serve_config_yaml_holds_no_environment_token_and_names_the_variables(tmp_path: Path) -> None:
    from meshrl.serve_config import build_serve_config, render_yaml

    cfg = load_config(None, [*ENV_OVERRIDES, "actor_rollout_ref.model.path=/models/x"])
    text = render_yaml(build_serve_config(cfg, tmp_path), cfg, tmp_path, "meshrl serve-config")
    for secret in SECRETS:
        assert secret not in text
    # the rollout replicas call the endpoints: every node's `ray start` needs their variables
    assert environment_endpoint_token_env(0) in text and "SANDBOX_KEY" in text


def test_agents_never_inherit_an_environment_token() -> None:
    from services.rollout.gateway import secret_env_names

    cfg = MeshConfig.model_validate({"environment": {"endpoints": [
        {"address": "127.0.0.1:1", "name": "sandbox", "token_env": "SANDBOX_KEY"},
    ]}})
    assert {"SANDBOX_KEY", TOKEN_ENV} <= secret_env_names(cfg)
