"""The param server as a Ray Serve application: a thin shim over ParamServerServicer.

One replica serves three doors onto one store:
- the gRPC methods through Serve's proxy (control calls; PublishWeights/FetchWeights work there
  too, but every message crosses an actor hop, so bulk bytes use the next door);
- a plain grpc.aio data plane inside the replica on param_server.host:port (zero-copy codec),
  advertised to consumers as WeightsRef.param_server_address (`data_address()`);
- the object_store transport's versions: their refs live in a plain Ray actor the replica creates
  (`object_refs()`, object_refs.py: lookups there skip Serve's router); the replica's store keeps
  their manifests, registered behind each publish (object refs cannot travel as protos).

    app = build_app({"config": cfg.model_dump(mode="json"), "run_dir": "runs/x"})
    serve.run(app, name="param_server", route_prefix="/param_server")
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

from ray import serve

from meshrl.v1 import param_server_pb2 as pb
from services.common.config import MeshConfig
from services.common.errors import FailedPrecondition, NotFound
from services.common.grpc_util import LocalContext
from services.common.logging import configure_logging, get_logger
from services.common.metrics import ReplicaMetrics, export_periodically
from services.common.priority import set_niceness
from services.common.security import serve_replica_security
from services.common.serve_util import grpc_shim, log_init_errors
from services.common.startup import StartupClock

from . import metrics as ps_metrics

if TYPE_CHECKING:
    from .server import ParamServerServer

log = get_logger(__name__)
DEPLOYMENT_NAME = "ParamServer"
APP_NAME = "param_server"
SERVICE = pb.DESCRIPTOR.services_by_name["ParamServerService"]


@serve.deployment(name=DEPLOYMENT_NAME, num_replicas=1, max_ongoing_requests=1024, health_check_period_s=10)
@grpc_shim(SERVICE)
class ParamServerDeployment:
    """Serve replica of the param server. Keep exactly one replica: the store is in its memory."""

    @log_init_errors
    async def __init__(self, config: dict[str, Any], run_dir: str | None = None, run_id: str = "") -> None:  # type: ignore[misc]
        clock = StartupClock("param_server")
        cfg = MeshConfig.model_validate(config)
        configure_logging("param_server", json=True, run_id=run_id or None)
        set_niceness(cfg.tuning.nice.param_server, key="tuning.nice.param_server")
        serve_replica_security(cfg, None, "param_server")
        # The store (torch) loads here, in the replica: `meshrl train`'s driver imports this module
        # for `build_app` while Ray and Serve start, and torch would cost it seconds of its GIL.
        from .server import ParamServerServer

        self.server: ParamServerServer = ParamServerServer(cfg, run_dir)
        await self.server.start()
        self._servicer = self.server.servicer
        self._metrics = ReplicaMetrics(ps_metrics.FAMILIES)
        self._metrics_task = export_periodically("param_server", lambda: ps_metrics.export(self._metrics, self._servicer))
        self._retain = cfg.param_server.retain_versions
        self._refs: Any = None  # the object_store versions' actor, created on first use
        self._refs_lock = asyncio.Lock()
        self._servicer.store.on_served = self._store_served
        if cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "object_store":
            from . import object_refs

            self._refs = object_refs.start(self._retain)  # its process starts beside the mesh's, not awaited
        clock.mark("ready")

    def data_address(self) -> str:
        """host:port of the direct data plane (what publishers should stream to)."""
        return self.server.address

    def check_health(self) -> None:
        if self._servicer._sweeper is not None and self._servicer._sweeper.done():
            raise RuntimeError("param server sweeper stopped")

    # ---- gRPC through Serve's proxy (grpc_shim adds the others) ---------------------------------

    async def PublishWeights(self, request_stream: Any, grpc_context: Any = None) -> pb.PublishWeightsResponse:
        """Client streaming: written by hand (its argument is Serve's gRPCInputStream)."""
        return await self._servicer.PublishWeights(request_stream, grpc_context or LocalContext())

    # ---- object_store transport ------------------------------------------------------------------

    async def object_refs(self) -> Any:
        """The actor holding the object_store versions' manifests and refs (object_refs.py):
        created on first use, and again if it died (its versions went with it)."""
        import ray

        from . import object_refs

        async with self._refs_lock:
            if self._refs is not None:
                try:
                    await asyncio.wait_for(self._refs.stats.remote(), timeout=60)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, TimeoutError) as exc:
                    log.warning("object_refs_lost", error=f"{type(exc).__name__}: {exc}",
                                hint="its object_store versions are gone; publishers register the next ones anew")
                    # One that is only unreachable or slow lives on for whoever holds its handle (a
                    # trainer would go on registering there while consumers that ask anew look up
                    # in the new one, finding nothing): killed, every holder's next call fails and
                    # its directory asks again (ServeDirectory._call), landing on the new actor.
                    with contextlib.suppress(Exception):  # already dead: nothing to kill
                        ray.kill(self._refs)
                    self._refs = None
            if self._refs is None:
                self._refs = object_refs.start(self._retain)
            return self._refs

    def _store_served(self, stored: Any) -> None:
        """The store's `on_served`: a consumer loaded a version through the store (FetchWeights,
        AcquireVersion). An object_store version's content lives in the object_refs actor, which
        would still take it for unseen and let a republish swap its refs under that consumer (the
        store refuses the board post, logged only: its manifest and the objects would disagree for
        good). Told here, the actor refuses other content too. Not awaited (a store call is synchronous): a republish
        reaching the actor in the same few ms still gets in, and the store refuses its board post."""
        if self._refs is None or "object_store" not in stored.manifest.transports:
            return  # no actor: no refs to protect
        try:
            self._refs.seen.remote(stored.policy_version, stored.manifest.checksum)  # a dropped ref: still run
        except Exception as exc:  # noqa: BLE001 -- never fails the consumer's call; the actor may be gone
            log.warning("object_refs_seen_not_sent", policy_version=stored.policy_version,
                        error=f"{type(exc).__name__}: {exc}")

    async def register_object_store_version(self, manifest: bytes, refs: list[Any] | None = None) -> bytes:
        """Put a version on the board (the store: ListVersions, GetManifest, metrics), `refs`
        (one list per bucket) given: into the object_refs actor first, where fetchers look it up."""
        from services.weights import convert  # loaded with the store (torch) by __init__

        m = convert.manifest_from_proto(pb.Manifest.FromString(manifest))
        if refs is not None:
            await (await self.object_refs()).register.remote(manifest, list(refs))
        stored = self._servicer.store.register(m.with_transports(["object_store"]), time.time())
        log.info("version_registered", transport="object_store", policy_version=stored.policy_version,
                 total_bytes=stored.total_bytes)
        return convert.manifest_to_proto(stored).SerializeToString()  # type: ignore[no-any-return]

    async def object_store_version(self, policy_version: int, consumer_id: str) -> tuple[bytes, list[Any]]:
        """(manifest, bucket refs) of a version, from the object_refs actor; negative = newest.
        Takes no hold (a reader's borrowed refs keep the objects); `consumer_id` is kept for the
        callers that pass it."""
        try:
            stored = self._servicer.store.get(policy_version)
        except NotFound:
            stored = None  # the board may not have it yet: the actor answers
        if stored is not None and "object_store" not in stored.manifest.transports:
            raise FailedPrecondition(
                f"version {stored.policy_version} is not in the object store (it travels over "
                f"{list(stored.manifest.transports)})"
            )
        return await (await self.object_refs()).lookup.remote(policy_version)  # type: ignore[no-any-return]

    async def release_version(self, policy_version: int, consumer_id: str) -> None:
        self._servicer.store.release(consumer_id, policy_version, time.time())

    async def __del__(self) -> None:
        await self.server.stop()


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder: args = {config: dict, run_dir?: str, run_id?: str}. Replica
    resources come from the config's `serve.param_server`."""
    cfg = MeshConfig.model_validate(args["config"])
    deploy = cfg.serve.param_server
    actor: dict[str, Any] = {"num_cpus": deploy.num_cpus}
    if deploy.num_gpus:
        actor["num_gpus"] = deploy.num_gpus
    if deploy.resources:
        actor["resources"] = deploy.resources
    if deploy.runtime_env:
        actor["runtime_env"] = deploy.runtime_env
    app = ParamServerDeployment.options(  # type: ignore[attr-defined]
        max_ongoing_requests=deploy.max_ongoing_requests, ray_actor_options=actor
    )
    return app.bind(args["config"], args.get("run_dir"), args.get("run_id", ""))  # type: ignore[no-any-return]
