"""The rollout replica as a Ray Serve deployment: a thin shim over RolloutWorker + engine.

    app = build_app(cfg)                           # serve.run(app, name="rollout")
    # Serve's gRPC ingress serves meshrl.v1.RolloutService (Generate is what validation uses)

Resources come from `serve.rollout` (num_cpus, num_gpus, resources={"NPU": 1}); with
`serve.rollout.autoscaling` the replica count follows in-flight prompt groups: every replica
reports `groups_in_flight` (record_autoscaling_stats) and `in_flight_policy` asks for
ceil(total / target_ongoing_requests) replicas. The coordinator's staleness budget bounds the
total, so set target_ongoing_requests below async_training.concurrent_samples_per_replica for
replicas to be added while every one of them is full. Shutdown (`__del__`) stops leasing and
returns the leases of all unfinished groups, so their prompts are re-issued at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from ray import serve

from meshrl.v1 import reward_pb2, rollout_pb2
from services.common.config import MeshConfig
from services.common.config.serve import AppDeployConfig
from services.common.errors import first_cause
from services.common.logging import configure_logging, get_logger
from services.common.metrics import ReplicaMetrics, export_periodically
from services.common.priority import set_niceness
from services.common.security import serve_replica_security
from services.common.serve_util import log_init_errors
from services.common.startup import StartupClock
from services.weights import WeightFetcher

from . import factory
from . import metrics as rollout_metrics
from .metrics import RolloutExporter
from .servicer import RolloutServicer
from .worker import Scorer

log = get_logger(__name__)

FetcherFactory = Callable[[MeshConfig], WeightFetcher]


DRAIN_TIMEOUT_S = 30.0
"""How long shutdown waits for the worker to return its leases and stop its groups."""
CLOSE_TIMEOUT_S = 30.0
"""What shutdown allows, after the drain, for the engine to stop (the transformers engine joins its
thread for up to 30 s) and the coordinator channel to close."""

SCORE_RETRY_S = 60.0
"""How long a Score call is retried while the reward replica that took it died and Serve replaces it
(scoring has no side effects); an error of the reward service itself is never retried here."""


def _handle_scorer(handle: Any, retry_s: float = SCORE_RETRY_S) -> Scorer:
    """A scorer that calls a reward deployment's `Score` method (ScoreRequest -> ScoreResponse)."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    async def score(items: list[reward_pb2.ScoreItem]) -> list[reward_pb2.ScoreResult]:
        deadline = time.monotonic() + retry_s
        delay = 0.5
        while True:
            try:
                resp = await handle.Score.remote(reward_pb2.ScoreRequest(items=items))
                return list(resp.results)
            except (RayActorError, ActorUnavailableError) as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("score_retry", items=len(items), error=first_cause(exc), retry_in_s=delay,
                            hint="the reward replica died; Serve replaces it")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    return score


class RolloutDeployment:
    """One rollout replica. Constructor args: the resolved config as a dict, and optionally a
    reward deployment handle (or a scorer callable) and a weight-fetcher factory."""

    @log_init_errors
    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        cfg: dict[str, Any],
        *,
        reward_handle: Any = None,
        scorer: Scorer | None = None,
        fetcher_factory: FetcherFactory | None = None,
    ) -> None:
        from services.common.grpc_util import MiB
        from services.coordinator.client import CoordinatorClient

        clock = StartupClock("rollout")
        self.cfg = MeshConfig.model_validate(cfg)
        ctx = serve.get_replica_context()
        replica_id = f"rollout-{ctx.replica_id.unique_id}"
        configure_logging("rollout", replica=replica_id)
        set_niceness(self.cfg.tuning.nice.rollout, key="tuning.nice.rollout")
        # Every client this replica makes (coordinator, reward, param server) sends the rollout token.
        serve_replica_security(self.cfg, "rollout", "rollout")
        engine, tok = factory.build_engine(self.cfg)
        self.engine = engine
        clock.mark("engine_built")
        w = self.cfg.rollout_worker
        self.coordinator = CoordinatorClient(
            factory.coordinator_address(self.cfg), application=w.coordinator_application, timeout_s=w.rpc_timeout_s,
            tls=bool(self.cfg.coordinator.tls_cert_file) and w.coordinator_application is None,
            max_message_bytes=self.cfg.coordinator.max_message_mb * MiB,
        )
        if scorer is None and reward_handle is not None:
            scorer = _handle_scorer(reward_handle)
        scorer = scorer or factory.default_scorer(self.cfg)
        fetcher: WeightFetcher | None
        if fetcher_factory is not None:
            fetcher = fetcher_factory(self.cfg)
        else:
            if self.cfg.rollout_worker.fetch_weights_from_param_server:
                from services.weights.transports.discovery import with_discovered_address

                self.cfg = await with_discovered_address(self.cfg)  # param_server.host=0.0.0.0
            fetcher = factory.default_fetcher(self.cfg, replica_id)
        self.worker = factory.build_worker(
            self.cfg, engine, tok, coordinator=self.coordinator, scorer=scorer, fetcher=fetcher, replica_id=replica_id
        )
        self.servicer = RolloutServicer(self.worker, factory.validation_sampling(self.cfg))
        clock.mark("worker_built")
        await engine.start()
        clock.mark("engine_started")
        if w.autostart:
            self.worker.start()
        self._metrics = RolloutExporter(ReplicaMetrics(rollout_metrics.FAMILIES), replica_id)
        self._metrics_task = export_periodically("rollout", self._export_metrics)
        clock.mark("ready")
        log.info("rollout_replica_ready", engine=engine.name, policy_version=engine.version)

    async def Generate(self, request: Any, grpc_context: Any = None) -> Any:
        return await self.servicer.Generate(request, grpc_context)

    async def UpdateWeights(self, request: Any, grpc_context: Any = None) -> Any:
        return await self.servicer.UpdateWeights(request, grpc_context)

    async def GetRolloutStatus(self, request: Any, grpc_context: Any = None) -> Any:
        return await self.servicer.GetRolloutStatus(request, grpc_context)

    async def Drain(self, request: Any, grpc_context: Any = None) -> Any:
        return await self.servicer.Drain(request, grpc_context)

    async def check_health(self) -> None:
        health = await self.engine.health()
        if not health.healthy:
            raise RuntimeError(f"rollout engine unhealthy: {health.detail}")
        if not self.worker.healthy:
            raise RuntimeError("rollout worker loop stopped; see the replica log")

    def _export_metrics(self) -> None:
        latest = self.worker.announced_version
        self._metrics.export(self.worker.status(), self.engine.stats(), latest)

    async def status(self) -> rollout_pb2.GetRolloutStatusResponse:
        """GetRolloutStatus's answer, for handle calls (`meshrl train` samples it for rollout metrics)."""
        return self.worker.status()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {"groups_in_flight": float(self.worker.groups_in_flight)}

    async def __del__(self) -> None:
        # Graceful drain: return every unfinished lease so another replica takes the prompts now
        # rather than after coordinator.lease_timeout_s.
        if not hasattr(self, "worker"):  # the constructor failed: nothing was leased
            return
        try:
            returned, _ = await asyncio.wait_for(self.worker.stop(finish_in_flight=False), DRAIN_TIMEOUT_S)
            log.info("rollout_replica_drained", returned_leases=returned)
        finally:
            try:
                await self.engine.close()
            finally:  # the channel is closed even when the engine fails to
                await self.coordinator.close()


def in_flight_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Serve autoscaling policy: replicas = ceil(in-flight groups / target per replica)."""
    metrics = (ctx.aggregated_metrics or {}).get("groups_in_flight", {})
    total = sum(metrics.values())
    target = max(ctx.config.target_ongoing_requests or 1.0, 1e-9)
    desired = math.ceil(total / target) if total else ctx.capacity_adjusted_min_replicas
    desired = max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, desired))
    return desired, {}


def deployment_options(app: AppDeployConfig) -> dict[str, Any]:
    """serve.deployment(...) options from serve.rollout. Serve kills a replica that is still in
    `__del__` graceful_shutdown_timeout_s after asking it to stop (20 s by default): the drain's
    bound plus the engine's and the channel's close must fit in it."""
    actor = app.ray_actor_options()
    opts: dict[str, Any] = {
        "ray_actor_options": actor,
        "max_ongoing_requests": app.max_ongoing_requests,
        "graceful_shutdown_timeout_s": DRAIN_TIMEOUT_S + CLOSE_TIMEOUT_S,
    }
    if app.autoscaling is None:
        opts["num_replicas"] = app.num_replicas
    else:
        a = app.autoscaling
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "policy": {"policy_function": "services.rollout.deployment:in_flight_policy"},
        }
    return opts


def build_app(
    cfg: MeshConfig | dict[str, Any],
    *,
    reward_handle: Any = None,
    scorer: Scorer | None = None,
    fetcher_factory: FetcherFactory | None = None,
) -> Any:
    """The rollout application, ready for serve.run. Called with args = {config: dict} (then the
    reward service and the param server are found from the config: rollout_worker.reward_application
    / param_server address). `app_builder` is the serve-config `import_path` target."""
    if isinstance(cfg, dict):
        cfg = MeshConfig.model_validate(cfg["config"] if "config" in cfg else cfg)
    dep = serve.deployment(name="Rollout", **deployment_options(cfg.serve.rollout))(RolloutDeployment)
    return dep.bind(  # type: ignore[attr-defined]
        cfg.model_dump(mode="json"), reward_handle=reward_handle, scorer=scorer, fetcher_factory=fetcher_factory
    )


def app_builder(args: dict[str, Any]) -> Any:
    """The serve-config `import_path` target: Serve calls builders with exactly one argument,
    args = {config: dict, run_dir?: str}."""
    return build_app(args)
