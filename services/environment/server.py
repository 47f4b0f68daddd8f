"""An environment as a plain grpc.aio server, without Ray (`meshrl environment serve`): the
environment a config describes (its verl tools and interactions, or a built-in) behind
EnvironmentService, with health, reflection, an optional token and TLS."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import grpc

from meshrl.v1 import environment_pb2, environment_pb2_grpc
from services.common.auth import Authorizer, Tokens
from services.common.grpc_util import add_health_and_reflection, bind_port, create_server, set_serving
from services.common.jsonutil import DEFAULT_MAX_DEPTH
from services.common.logging import get_logger
from services.common.security import warn_if_exposed

from .base import Environment
from .config import EnvironmentConfig
from .core import SessionTable
from .servicer import EnvironmentServicer

log = get_logger(__name__)
SERVICE_NAME = environment_pb2.DESCRIPTOR.services_by_name["EnvironmentService"].full_name
METHODS = tuple(f"/{SERVICE_NAME}/{m}" for m in ("Start", "Step", "Close"))
TOKEN_ENV = "MESHRL_ENVIRONMENT_TOKEN"
"""Where the server's token comes from when `environment.token` is null (keeps it out of config files)."""


class EnvironmentServer:
    """Owns a grpc.aio server and the session table over `env`. Build and start it inside the
    event loop that will serve it; `port` 0 binds any free port (see `address`)."""

    def __init__(self, env: Environment, cfg: EnvironmentConfig, *, host: str | None = None, port: int | None = None,
                 max_json_depth: int = DEFAULT_MAX_DEPTH) -> None:
        self.cfg = cfg
        self.host = host if host is not None else cfg.host
        self.table = SessionTable(env, max_sessions=cfg.max_sessions, session_ttl_s=cfg.session_ttl_s,
                                  close_wait_s=cfg.close_wait_s, max_tool_calls=cfg.max_tool_calls,
                                  max_message_chars=cfg.max_message_chars)
        self.servicer = EnvironmentServicer(self.table, max_json_depth=max_json_depth)
        # The caller is a rollout replica (the role table's EnvironmentService entry), checked before
        # any request is decoded or a session touched: the environment's own token proves that
        # role, else the mesh's role tokens (MESHRL_<ROLE>_TOKEN) as on every meshrl server.
        own = cfg.token or os.environ.get(TOKEN_ENV) or None
        self.auth = Authorizer(Tokens(rollout=own)) if own else Authorizer.from_config(None)
        self.server = create_server(auth=self.auth)
        environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(self.servicer, self.server)
        self._health = add_health_and_reflection(self.server, [SERVICE_NAME])
        bind = f"{self.host}:{cfg.port if port is None else port}"
        creds = None
        if cfg.tls_cert_file and cfg.tls_key_file:
            creds = grpc.ssl_server_credentials([(Path(cfg.tls_key_file).read_bytes(), Path(cfg.tls_cert_file).read_bytes())])
        self.port = bind_port(self.server, bind, "environment.port", creds)
        warn_if_exposed("environment", self.host, auth=self.auth, tls=creds is not None, fix_key="environment.tls_cert_file")
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await set_serving(self._health, [SERVICE_NAME])
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="environment-sessions")
        log.info("environment_listening", address=self.address, environment=self.table.env.name)

    async def _sweep(self) -> None:
        period = min(30.0, self.cfg.session_ttl_s / 2)
        while True:
            await asyncio.sleep(period)
            await self.table.expire()

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.server.stop(grace_s)
        await self.table.close_all()  # the sessions still open release their tool instances
        await self.table.env.aclose()
