"""The param server as a plain grpc.aio server, without Ray (`meshrl param-server serve`, tests,
benchmarks, and the data plane inside the Serve replica). Weight chunks use the zero-copy codec
of services/weights/wire.py; every other message is plain protobuf."""

from __future__ import annotations

import os
from typing import Any

import grpc
import grpc.aio

from meshrl.v1 import param_server_pb2 as pb
from services.common.config import MeshConfig
from services.common.config.param_server import ParamServerConfig
from services.common.grpc_util import add_health_and_reflection, bind_port, create_server, set_serving
from services.common.logging import get_logger
from services.common.net import WILDCARD_HOSTS, host_port, local_ip
from services.common.security import ServerSecurity
from services.weights import wire
from services.weights.hostmem import tune_malloc

from .factory import build_servicer
from .servicer import ParamServerServicer

log = get_logger(__name__)
SERVICE_NAME = wire.SERVICE
MiB = 1 << 20


def add_to_server(servicer: ParamServerServicer, server: Any) -> None:
    """Register the service with the raw chunk codec on PublishWeights / FetchWeights."""
    handlers = {
        "PublishWeights": grpc.stream_unary_rpc_method_handler(
            servicer.PublishWeights,
            request_deserializer=wire.publish_request_deserializer,
            response_serializer=pb.PublishWeightsResponse.SerializeToString,
        ),
        "FetchWeights": grpc.unary_stream_rpc_method_handler(
            servicer.FetchWeightsRaw,
            request_deserializer=pb.FetchWeightsRequest.FromString,
            response_serializer=wire.fetch_response_serializer,
        ),
    }
    unary: list[tuple[str, Any, Any]] = [
        ("GetManifest", pb.GetManifestRequest, pb.GetManifestResponse),
        ("ListVersions", pb.ListVersionsRequest, pb.ListVersionsResponse),
        ("AcquireVersion", pb.AcquireVersionRequest, pb.AcquireVersionResponse),
        ("ReleaseVersion", pb.ReleaseVersionRequest, pb.ReleaseVersionResponse),
        ("Rendezvous", pb.RendezvousRequest, pb.RendezvousResponse),
    ]
    for name, req, resp in unary:
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=req.FromString, response_serializer=resp.SerializeToString
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def advertised(cfg: ParamServerConfig, port: int) -> str:
    if cfg.advertise_address:
        return cfg.advertise_address
    host = local_ip() if cfg.host in WILDCARD_HOSTS else cfg.host
    return host_port(host, port)


class ParamServerServer:
    """Owns a grpc.aio server bound to param_server.host:port and the servicer behind it."""

    def __init__(self, cfg: MeshConfig | ParamServerConfig, run_dir: str | os.PathLike[str] | None = None) -> None:
        self.cfg = cfg.param_server if isinstance(cfg, MeshConfig) else cfg
        if self.cfg.tune_malloc:
            tune_malloc()
        self.servicer = build_servicer(cfg, run_dir)
        self.security = ServerSecurity.from_config(cfg if isinstance(cfg, MeshConfig) else None)
        self.servicer.auth = self.security.auth
        self.server = create_server(max_message_bytes=self.cfg.max_message_mb * MiB, auth=self.security.auth,
                                    limits=self.security.limits)
        add_to_server(self.servicer, self.server)
        self._health = add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = bind_port(self.server, host_port(self.cfg.host, self.cfg.port), "param_server.port",
                              self.security.credentials)
        self.security.warn_if_exposed("param_server", self.cfg.host)
        self.servicer.address = advertised(self.cfg, self.port)

    @property
    def address(self) -> str:
        return self.servicer.address

    async def start(self) -> None:
        await self.server.start()
        self.servicer.start_sweeper()
        await set_serving(self._health, [SERVICE_NAME])
        log.info("param_server_listening", address=self.address)

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.server.stop(grace_s)
        await self.servicer.close()
