"""Where the param server's data plane is, when only the running replica knows it.

With `param_server.host=0.0.0.0` (the multi-node switch) the param server replica may land on any
node; it binds every interface there and advertises that node's IP
(`ParamServerDeployment.data_address`). Publishers and fetchers under Ray ask it once, before
they are built:

    trainer replica / rollout replica      param_server app (any node)
      with_discovered_address(cfg) ──handle──▶ data_address() -> "10.0.0.5:50071"
      cfg.param_server.advertise_address = that, so every later `data_address(ps)` (make_publisher,
      make_fetcher, the collective rendezvous) dials it, and the WeightsRef a publisher returns
      carries it to every consumer.

The apps of one `serve deploy` start together: until the param server app exists and answers,
the ask is retried for `param_server.discover_wait_s`. A loopback or fixed host, or a given
`advertise_address`, is used as configured (nothing is asked).
"""

from __future__ import annotations

import asyncio
import time

from services.common.config import MeshConfig
from services.common.config.param_server import discovers_address
from services.common.errors import Unavailable
from services.common.logging import get_logger

log = get_logger(__name__)

APP_NAME = "param_server"
DEPLOYMENT_NAME = "ParamServer"
CALL_TIMEOUT_S = 30.0


async def ask_data_address(app_name: str = APP_NAME, deployment: str = DEPLOYMENT_NAME) -> str:
    """The running param server's advertised data-plane address (one handle call)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app_name)
    return str(await asyncio.wait_for(handle.data_address.remote(), CALL_TIMEOUT_S))


async def with_discovered_address(cfg: MeshConfig, *, app_name: str = APP_NAME) -> MeshConfig:
    """`cfg` with `param_server.advertise_address` set to what the param server app answers, when
    the config leaves the address to discovery (`discovers_address`); else `cfg` itself."""
    ps = cfg.param_server
    if not discovers_address(ps):
        return cfg
    deadline = time.monotonic() + ps.discover_wait_s
    delay = 0.5
    while True:
        try:
            address = await ask_data_address(app_name)
            break
        except Exception as exc:  # app not deployed yet, replica starting: retried until the deadline
            if time.monotonic() + delay > deadline:
                raise Unavailable(
                    f"the param server app {app_name!r} did not say where its data plane is within "
                    f"param_server.discover_wait_s={ps.discover_wait_s:g}s ({type(exc).__name__}: {exc}); is it "
                    "deployed? (or set param_server.advertise_address)"
                ) from exc
            log.warning("param_server_not_up_yet", application=app_name, retry_in_s=delay, error=str(exc)[:200])
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
    log.info("param_server_discovered", address=address)
    return cfg.model_copy(update={"param_server": ps.model_copy(update={"advertise_address": address})})
