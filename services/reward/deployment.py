"""The reward service as a Ray Serve application: a thin shim over RewardServicer.

    start_serve(9000)   # services.common.serve_util: the gRPC ingress for every meshrl service
    serve.run(build_app({"config": cfg.model_dump(mode="json")}), name=APP_NAME, route_prefix=ROUTE_PREFIX)
    # gRPC: RewardClient("127.0.0.1:9000", application="reward")
    # in-cluster: HandleScorer(serve.get_app_handle("reward"))

Batching. Concurrent Score requests are grouped by `@serve.batch` (`reward.max_batch_size`
requests, `reward.batch_wait_timeout_s`) and their items scored in one pipeline call, so the
items of many small requests share endpoint calls and thread-pool work. The batch function only
*starts* that work and hands each request a future for its slice: a batch waiting on a down
endpoint never holds up the batches behind it, and a cancelled request (client deadline) never
cancels the others' work. A request fails only if one of its own items failed.

Health. `check_health` fails when abandoned (timed-out or cancelled) scorer threads pile up (see pool.py); Serve then
replaces the replica. A down external endpoint is not a health failure: its items wait, visible in
`status()` and the `meshrl_reward_*` metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.deployment import Application
from ray.util import metrics

from meshrl.v1 import reward_pb2
from services.common.config import MeshConfig
from services.common.config.serve import AppDeployConfig
from services.common.errors import MeshError
from services.common.logging import configure_logging, get_logger
from services.common.metrics import Family, ReplicaMetrics
from services.common.priority import set_niceness
from services.common.security import serve_replica_security
from services.common.serve_util import SERVICER_FUNCTIONS, grpc_shim, log_init_errors
from services.common.startup import StartupClock

from .factory import build_pipeline
from .samples import Sample
from .samples import Score as RewardScore  # `Score` is also the RPC method's name below
from .servicer import RewardServicer

log = get_logger(__name__)

SERVICE = reward_pb2.DESCRIPTOR.services_by_name["RewardService"]
GRPC_SERVICER_FUNCTIONS = SERVICER_FUNCTIONS
APP_NAME = "reward"
# Serve's proxies only route to applications that have a route prefix, gRPC included (there the
# `application` metadata picks the app); with route_prefix=None the ingress answers NOT_FOUND.
ROUTE_PREFIX = "/reward"


def _slice(task: asyncio.Future[list[RewardScore | MeshError]], start: int, n: int) -> asyncio.Future[list[RewardScore]]:
    """A future for items [start, start+n) of a batch: their scores, or the first error among them."""
    out: asyncio.Future[list[RewardScore]] = asyncio.get_running_loop().create_future()

    def done(t: asyncio.Future[list[RewardScore | MeshError]]) -> None:
        if out.done():
            return
        if t.cancelled():
            out.cancel()
            return
        exc = t.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        part = t.result()[start : start + n]
        err = next((o for o in part if isinstance(o, BaseException)), None)
        if err is not None:
            out.set_exception(err)
        else:
            out.set_result(part)  # type: ignore[arg-type]

    task.add_done_callback(done)
    return out


@serve.deployment(name="Reward")
@grpc_shim(SERVICE)
class RewardDeployment:
    """One reward replica. gRPC ingress calls `Score` (added by grpc_shim); handles call
    `score_request`, which raises MeshErrors instead of setting a status."""

    @log_init_errors
    def __init__(self, config: dict[str, Any]) -> None:
        clock = StartupClock("reward")
        cfg = MeshConfig.model_validate(config)
        ctx = serve.get_replica_context()
        replica = getattr(getattr(ctx, "replica_id", None), "unique_id", None)
        configure_logging("reward", json=True, replica=replica)
        set_niceness(cfg.tuning.nice.reward, key="tuning.nice.reward")
        serve_replica_security(cfg, None, "reward")
        self.cfg = cfg
        self.pipeline = build_pipeline(cfg)
        self._servicer = RewardServicer(self.pipeline, max_items=cfg.reward.max_items_per_request, score_fn=self._score,
                                        max_json_depth=cfg.security.limits.max_json_depth)
        self._batch.set_max_batch_size(cfg.reward.max_batch_size)  # type: ignore[attr-defined]
        self._batch.set_batch_wait_timeout_s(cfg.reward.batch_wait_timeout_s)  # type: ignore[attr-defined]
        clock.mark("ready")
        self._inflight: set[asyncio.Future[Any]] = set()
        tags = ("endpoint",)
        # Counters through ReplicaMetrics: they exist at 0 from the first export (an alert on
        # failed items sees the series before the first failure).
        self._counters = ReplicaMetrics([
            Family("meshrl_reward_items", "Items scored by this replica.", "counter"),
            Family("meshrl_reward_items_failed", "Items that could not be scored (errors).", "counter"),
        ])
        self._m_waiting = metrics.Gauge("meshrl_reward_endpoint_waiting_items", "Items waiting for a down endpoint.", tag_keys=tags)
        self._m_open = metrics.Gauge("meshrl_reward_endpoint_open", "1 while the endpoint's circuit breaker is not closed.", tag_keys=tags)
        self._m_abandoned = metrics.Gauge("meshrl_reward_abandoned_threads", "Abandoned scorer threads (timed out or their caller cancelled) still running.")
        log.info("reward_replica_ready", stages=[s.name for s in self.pipeline.stages], endpoints=len(self.pipeline.remotes))

    # ---- handle entry points ------------------------------------------------------------------------

    async def score_request(self, request: Any) -> Any:
        """ScoreRequest -> ScoreResponse for DeploymentHandle callers; raises MeshErrors."""
        return await self._servicer.score_request(request)

    def status(self) -> dict[str, Any]:
        self._export_metrics()
        return self.pipeline.status()

    async def check_health(self) -> None:
        self._export_metrics()
        reason = self.pipeline.unhealthy_reason()
        if reason is not None:
            raise RuntimeError(reason)

    # ---- batching ---------------------------------------------------------------------------------

    async def _score(self, samples: Sequence[Sample]) -> list[RewardScore]:
        fut = await self._batch(list(samples))
        return await fut

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.01)
    async def _batch(self, requests: list[list[Sample]]) -> list[asyncio.Future[list[RewardScore]]]:
        flat = [s for r in requests for s in r]
        task = asyncio.ensure_future(self.pipeline.score_each(flat))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        task.add_done_callback(lambda _: self._export_metrics())
        out, start = [], 0
        for r in requests:
            out.append(_slice(task, start, len(r)))
            start += len(r)
        return out

    def _export_metrics(self) -> None:
        st = self.pipeline.status()
        self._counters.count_to("meshrl_reward_items", st["items_scored"])
        self._counters.count_to("meshrl_reward_items_failed", st["items_failed"])
        self._m_abandoned.set(st["pool"]["abandoned_threads"])
        for ep in st["endpoints"]:
            tags = {"endpoint": ep["name"]}
            self._m_waiting.set(ep["waiting_items"], tags=tags)
            self._m_open.set(0.0 if ep["state"] == "closed" else 1.0, tags=tags)

    def __del__(self) -> None:
        self.pipeline.pool.close()


def deployment_options(app: AppDeployConfig) -> dict[str, Any]:
    """Serve deployment options from a `serve.<app>` section."""
    actor = app.ray_actor_options()
    opts: dict[str, Any] = {
        "ray_actor_options": actor,
        "max_ongoing_requests": app.max_ongoing_requests,
        # One access-log line per Score call is noise at rollout rates (and CPU on small hosts);
        # the meshrl_reward_* metrics and status() carry the counts.
        "logging_config": {"enable_access_log": False},
    }
    if app.autoscaling is not None:
        opts["autoscaling_config"] = app.autoscaling.model_dump()
    else:
        opts["num_replicas"] = app.num_replicas
    return opts


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder (also the `import_path` target of serve-config YAML):
    args = {config: MeshConfig as a dict}. The config's `serve.reward` section sets replicas, CPUs
    and autoscaling. A custom reward file path is made absolute, so replicas find it whatever their
    working directory."""
    cfg = MeshConfig.model_validate(args.get("config", {}))
    crf = cfg.custom_reward_function
    if crf.path and (crf.path.endswith(".py") or "/" in crf.path) and Path(crf.path).expanduser().is_file():
        cfg = cfg.model_copy(deep=True)
        cfg.custom_reward_function.path = str(Path(crf.path).expanduser().resolve())
    options = deployment_options(cfg.serve.reward)
    deployment = RewardDeployment.options(**options)  # type: ignore[attr-defined]
    return deployment.bind(cfg.model_dump(mode="json"))  # type: ignore[no-any-return]

