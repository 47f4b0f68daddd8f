"""The coordinator as a Ray Serve deployment (one stateful replica) behind Serve's gRPC ingress.

    app = build_app({"config": cfg.model_dump(mode="json"), "run_dir": "runs/x"})
    serve.run(app, name="coordinator", route_prefix="/coordinator")

`build_app` is also the `import_path` target of `meshrl serve-config` YAML.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from ray import serve

from meshrl.v1 import coordinator_pb2
from services.common.config import MeshConfig
from services.common.logging import configure_logging
from services.common.metrics import ReplicaMetrics, export_periodically
from services.common.priority import set_niceness
from services.common.security import serve_replica_security
from services.common.serve_util import grpc_shim, log_init_errors
from services.common.startup import StartupClock

from . import metrics
from .factory import build_servicer
from .servicer import CoordinatorServicer

SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"]
KV_NAMESPACE = "meshrl_coordinator"


def open_servicer(
    cfg: MeshConfig, run_dir: str, run_id: str = "", session: str = "", resume: bool = False
) -> CoordinatorServicer:
    """The replica's servicer. A replica of a session whose ledger a replica opened before is
    Serve restarting it (a failed health check: the ledger deleted or moved, check_readable; a
    crash): it continues that run, as `meshrl train --resume` does, and refuses a ledger that is
    not there (Ledger's create). Without this, that restart created a fresh ledger at the path
    and leased from prompt 0 while the trainer went on at its step. The mark is kept in Ray's
    key-value store (the GCS), which outlives the replicas of a session, not the cluster."""
    from ray.experimental import internal_kv

    seen = bool(session) and internal_kv._internal_kv_get(session, namespace=KV_NAMESPACE) is not None
    servicer = build_servicer(cfg, run_dir, run_id, session, resume=resume or seen)
    if session:
        internal_kv._internal_kv_put(session, servicer.core.ledger.path, namespace=KV_NAMESPACE)
    return servicer


@serve.deployment(name="Coordinator", num_replicas=1, max_ongoing_requests=1024, health_check_period_s=10)
@grpc_shim(SERVICE)
class CoordinatorDeployment:
    """A thin shim: every RPC goes to CoordinatorServicer (servicer.py)."""

    @log_init_errors
    async def __init__(  # type: ignore[misc]
        self, config: dict[str, Any], run_dir: str, run_id: str = "", session: str = "", resume: bool = False
    ) -> None:
        clock = StartupClock("coordinator")
        cfg = MeshConfig.model_validate(config)
        configure_logging("coordinator", json=True, run_id=run_id or None)
        set_niceness(cfg.tuning.nice.coordinator, key="tuning.nice.coordinator")
        serve_replica_security(cfg, None, "coordinator")
        # SESSION: fixed by whoever deploys the app, so a restarted replica keeps a pending Stop
        # and its run's ledger. RESUME (`meshrl train --resume`): that ledger must be there.
        self._servicer = open_servicer(cfg, run_dir, run_id, session, resume)
        self._servicer.start_sweeper()
        self._metrics = ReplicaMetrics(metrics.FAMILIES)
        clock.mark("ready")
        self._exports = 0
        self._audit: dict[str, Any] | None = None
        self._metrics_task = export_periodically("coordinator", self._export_metrics)

    def _export_metrics(self) -> Awaitable[None] | None:
        # The audit scans the ledger: every 6th export (30 s), and the first, off the event loop
        # (servicer.audit). Its numbers are set again at every export (a gauge recorded once,
        # early in a replica's life, may be exported before Ray's metrics agent is up and then
        # never seen).
        audit = self._exports % 6 == 0
        self._exports += 1
        if audit:
            return self._export_audited()
        metrics.export(self._metrics, self._servicer.status(), self._audit)
        return None

    async def _export_audited(self) -> None:
        self._audit = await self._servicer.audit()
        metrics.export(self._metrics, self._servicer.status(), self._audit)

    def check_health(self) -> None:
        """Unhealthy when the ledger can no longer be read (Serve restarts the replica, which
        continues from the same ledger file)."""
        self._servicer.core.ledger.check_readable()

    async def audit(self) -> dict[str, Any]:
        """Ledger audit (handle call, for tests and `meshrl train`'s end-of-run report)."""
        return await self._servicer.audit()


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder: args = {config: dict, run_dir: str, run_id?: str, session?: str,
    resume?: bool}.
    The replica's Ray resources come from the config's `serve.coordinator`."""
    actor = MeshConfig.model_validate(args["config"]).serve.coordinator.ray_actor_options()
    return CoordinatorDeployment.options(ray_actor_options=actor).bind(  # type: ignore[attr-defined]
        args["config"], args["run_dir"], args.get("run_id", ""), args.get("session", ""),
        bool(args.get("resume", False)),
    )  # type: ignore[attr-defined]
