"""The coordinator as a plain grpc.aio server, without Ray (`meshrl coordinator serve`)."""

from __future__ import annotations

import os
from pathlib import Path

from meshrl.v1 import coordinator_pb2
from services.common.config import MeshConfig
from services.common.grpc_util import MiB, add_health_and_reflection, bind_port, create_server, set_serving
from services.common.logging import get_logger
from services.common.security import ServerSecurity

from . import wire
from .factory import build_servicer
from .servicer import CoordinatorServicer

log = get_logger(__name__)
SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name


class CoordinatorServer:
    """Owns a grpc.aio server bound to host:port and the servicer behind it."""

    def __init__(self, cfg: MeshConfig, run_dir: str | os.PathLike[str], *, resume: bool = False) -> None:
        """RESUME (`meshrl coordinator serve --resume`): a restart continuing the run, whose ledger
        must be there (Ledger's create): without it a lost ledger was silently a fresh run, leasing
        from prompt 0 beside the trainer's checkpoint."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.servicer: CoordinatorServicer = build_servicer(cfg, run_dir, resume=resume)
        c = cfg.coordinator
        # coordinator.tls_* (older keys) win over security.tls.* for this server.
        self.security = ServerSecurity.from_config(cfg, cert_file=c.tls_cert_file, key_file=c.tls_key_file)
        self.server = create_server(max_message_bytes=c.max_message_mb * MiB, auth=self.security.auth,
                                    limits=cfg.security.limits)
        wire.add_to_server(self.servicer, self.server)
        self._health = add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = bind_port(self.server, f"{c.host}:{c.port}", "coordinator.port", self.security.credentials)
        self.security.warn_if_exposed("coordinator", c.host, fix_key="security.tls.cert_file (or coordinator.tls_cert_file)")

    @property
    def address(self) -> str:
        return f"{self.cfg.coordinator.host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        self.servicer.start_sweeper()
        await set_serving(self._health, [SERVICE_NAME])
        log.info("coordinator_listening", address=self.address, ledger=self.servicer.core.ledger.path)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.server.stop(grace_s)
        self.servicer.core.ledger.close()
