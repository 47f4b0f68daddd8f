"""The param server as a Ray Serve application: a thin shim over ParamServerServicer.

One replica serves three doors onto one store:
- the gRPC methods through Serve's proxy (control calls; PublishWeights/FetchWeights work there
  too, but every message crosses an actor hop, so bulk bytes use the next door);
- a plain grpc.aio data plane inside the replica on param_server.host:port (zero-copy codec),
  advertised to consumers as WeightsRef.param_server_address (`data_address()`);
- handle methods for the object_store transport (object refs cannot travel as protos).

    app = build_app(cfg, run_dir)          # serve.run(app, name="param_server")
"""

from __future__ import annotations

import os
import time
from typing import Any

from meshrl.v1 import param_server_pb2 as pb
from services.common.config import MeshConfig
from services.common.errors import FailedPrecondition
from services.common.logging import configure_logging, get_logger

from . import convert
from .config import ParamServerConfig
from .server import ParamServerServer

log = get_logger(__name__)
DEPLOYMENT_NAME = "ParamServer"
APP_NAME = "param_server"


class ParamServerDeployment:
    """Serve replica of the param server. Keep exactly one replica: the store is in its memory."""

    async def __init__(self, param_server: dict[str, Any] | None = None, run_dir: str | None = None) -> None:
        configure_logging("param_server")
        self.cfg = ParamServerConfig.model_validate(param_server or {})
        self.server = ParamServerServer(self.cfg, run_dir)
        await self.server.start()
        self.servicer = self.server.servicer

    def data_address(self) -> str:
        """host:port of the direct data plane (what publishers should stream to)."""
        return self.server.address

    def check_health(self) -> None:
        if self.servicer._sweeper is not None and self.servicer._sweeper.done():
            raise RuntimeError("param server sweeper stopped")

    # ---- gRPC through Serve's proxy ---------------------------------------------------------------

    async def PublishWeights(self, request_stream: Any, grpc_context: Any = None) -> pb.PublishWeightsResponse:
        return await self.servicer.PublishWeights(request_stream, grpc_context)

    async def FetchWeights(self, request: pb.FetchWeightsRequest, grpc_context: Any = None) -> Any:
        async for item in self.servicer.FetchWeights(request, grpc_context):
            yield item

    async def GetManifest(self, request: pb.GetManifestRequest, grpc_context: Any = None) -> pb.GetManifestResponse:
        return await self.servicer.GetManifest(request, grpc_context)

    async def ListVersions(self, request: pb.ListVersionsRequest, grpc_context: Any = None) -> pb.ListVersionsResponse:
        return await self.servicer.ListVersions(request, grpc_context)

    async def AcquireVersion(self, request: pb.AcquireVersionRequest, grpc_context: Any = None) -> pb.AcquireVersionResponse:
        return await self.servicer.AcquireVersion(request, grpc_context)

    async def ReleaseVersion(self, request: pb.ReleaseVersionRequest, grpc_context: Any = None) -> pb.ReleaseVersionResponse:
        return await self.servicer.ReleaseVersion(request, grpc_context)

    async def Rendezvous(self, request: pb.RendezvousRequest, grpc_context: Any = None) -> pb.RendezvousResponse:
        return await self.servicer.Rendezvous(request, grpc_context)

    # ---- object_store transport (handle calls) ----------------------------------------------------

    async def register_object_store_version(self, manifest: bytes, refs: list[Any]) -> bytes:
        """Register a version whose buckets are `refs` (nested in a list, so they stay refs)."""
        m = convert.manifest_from_proto(pb.Manifest.FromString(manifest))
        stored = self.servicer.store.register(m.with_transports(["object_store"]), time.time(), payload=list(refs))
        log.info("version_registered", transport="object_store", policy_version=stored.policy_version,
                 total_bytes=stored.total_bytes)
        return convert.manifest_to_proto(stored).SerializeToString()  # type: ignore[no-any-return]

    async def object_store_version(self, policy_version: int, consumer_id: str) -> tuple[bytes, list[Any]]:
        """Pin a version for `consumer_id` and return (manifest, bucket refs); negative = newest."""
        now = time.time()
        m = self.servicer.store.acquire(consumer_id, policy_version, now)
        stored = self.servicer.store.get(m.policy_version)
        if not isinstance(stored.payload, list):
            raise FailedPrecondition(
                f"version {m.policy_version} is not in the object store (it travels over {list(m.transports)})"
            )
        return convert.manifest_to_proto(m).SerializeToString(), list(stored.payload)

    async def release_version(self, policy_version: int, consumer_id: str) -> None:
        self.servicer.store.release(consumer_id, policy_version, time.time())

    async def __del__(self) -> None:
        await self.server.stop()


def build_app(cfg: MeshConfig, run_dir: str | os.PathLike[str] | None = None) -> Any:
    """The Serve application (bind it with serve.run(app, name=APP_NAME))."""
    from ray import serve

    deploy = cfg.serve.param_server
    options: dict[str, Any] = {"num_cpus": deploy.num_cpus}
    if deploy.num_gpus:
        options["num_gpus"] = deploy.num_gpus
    if deploy.resources:
        options["resources"] = deploy.resources
    if deploy.runtime_env:
        options["runtime_env"] = deploy.runtime_env
    return (
        serve.deployment(ParamServerDeployment)
        .options(name=DEPLOYMENT_NAME, num_replicas=1, max_ongoing_requests=deploy.max_ongoing_requests,
                 ray_actor_options=options)
        .bind(cfg.param_server.model_dump(), str(run_dir) if run_dir is not None else None)
    )
