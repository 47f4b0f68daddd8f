"""Auth holds through Ray Serve's gRPC proxy, which takes no interceptors: rpc_method checks the
role table and string lengths there, with the codes and messages of the plain servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from services.common.config import load_config
from services.common.security import ChannelSecurity
from services.coordinator.client import CoordinatorClient

from .mesh import OVERRIDES, TOKENS

APP = "coordinator_auth"


def test_role_table_behind_the_proxy(serve_grpc_port: int, tmp_path: Path) -> None:
    from ray import serve

    from services.coordinator.deployment import CoordinatorDeployment

    cfg = load_config(None, OVERRIDES)
    # The replica reads its tokens from its environment, as under `meshrl train` (never the config).
    env = TOKENS.as_env()
    app = CoordinatorDeployment.options(ray_actor_options={"num_cpus": 0.1, "runtime_env": {"env_vars": env}}).bind(
        cfg.model_dump(mode="json"), str(tmp_path)
    )
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    address = f"127.0.0.1:{serve_grpc_port}"

    async def code(token: str | None, call: str, *args: object) -> tuple[grpc.StatusCode, str]:
        async with CoordinatorClient(address, application=APP, security=ChannelSecurity(token=token), timeout_s=60) as c:
            try:
                await getattr(c, call)(*args)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    async def main() -> None:
        got, details = await code(None, "status")
        assert got == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer <token>" in details
        assert (await code("wrong", "status"))[0] == grpc.StatusCode.UNAUTHENTICATED
        got, details = await code(TOKENS.rollout, "status")
        assert got == grpc.StatusCode.PERMISSION_DENIED and "operator" in details
        assert (await code(TOKENS.operator, "status"))[0] == grpc.StatusCode.OK
        assert (await code(TOKENS.trainer, "lease", "r", 1))[0] == grpc.StatusCode.PERMISSION_DENIED
        assert (await code(TOKENS.rollout, "lease", "r", 1))[0] == grpc.StatusCode.OK
        got, details = await code(TOKENS.rollout, "lease", "r" * 1000, 1)
        assert got == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("replica_id:"), details

    try:
        asyncio.run(main())
    finally:
        serve.delete(APP)

