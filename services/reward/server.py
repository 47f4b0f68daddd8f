"""The reward service as a plain grpc.aio server, without Ray (tests, single-process runs)."""

from __future__ import annotations

from meshrl.v1 import reward_pb2, reward_pb2_grpc
from services.common.config import MeshConfig
from services.common.grpc_util import add_health_and_reflection, bind_port, create_server, set_serving
from services.common.logging import get_logger
from services.common.security import ServerSecurity

from .factory import build_pipeline
from .servicer import RewardServicer

log = get_logger(__name__)
SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name


class RewardServer:
    """Owns a grpc.aio server bound to host:port and the pipeline behind it. Build and start it
    inside the event loop that will serve it."""

    def __init__(self, cfg: MeshConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.cfg = cfg
        self.host = host
        self.pipeline = build_pipeline(cfg)
        self.servicer = RewardServicer(self.pipeline, max_items=cfg.reward.max_items_per_request,
                                       max_json_depth=cfg.security.limits.max_json_depth)
        self.security = ServerSecurity.from_config(cfg)
        self.servicer.auth = self.security.auth
        self.server = create_server(auth=self.security.auth, limits=self.security.limits)
        reward_pb2_grpc.add_RewardServiceServicer_to_server(self.servicer, self.server)
        self._health = add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = bind_port(self.server, f"{host}:{port}", "--port", self.security.credentials)
        self.security.warn_if_exposed("reward", host)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await set_serving(self._health, [SERVICE_NAME])
        log.info("reward_listening", address=self.address)

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.server.stop(grace_s)
        await self.pipeline.close()
