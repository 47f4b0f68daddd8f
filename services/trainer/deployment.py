"""The trainer as a Ray Serve application: one replica drives one training group.

    app = build_app({"config": cfg.model_dump(mode="json"), "run_dir": "runs/x"})
    serve.run(app, name="trainer", route_prefix="/trainer")

The replica builds the rank actors (a placement group of their own) and the loop in its
constructor, then runs the loop as a task on its event loop; TrainerService RPCs (Serve's gRPC
ingress) and handle calls read its status. A loop that failed makes `check_health` raise, so Serve
restarts the replica, which resumes from the newest checkpoint. `build_app` is also the
`import_path` target of serve-config YAML (then only `config` and `run_dir` are given).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.serve import Application

from meshrl.v1 import trainer_pb2
from services.common.config import MeshConfig
from services.common.config.serve import AppDeployConfig
from services.common.logging import configure_logging, get_logger
from services.common.metrics import ReplicaMetrics, export_periodically
from services.common.priority import set_niceness
from services.common.security import serve_replica_security
from services.common.serve_util import grpc_shim, log_init_errors
from services.common.startup import StartupClock

from . import metrics as trainer_metrics
from .ranks import SpawnedRanks, spawn_for

if TYPE_CHECKING:
    from .factory import TrainerParts

log = get_logger(__name__)

SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]


@serve.deployment(name="Trainer", num_replicas=1, health_check_period_s=10)
@grpc_shim(SERVICE)
class TrainerDeployment:
    """A thin shim over services.trainer.factory.build_trainer; every RPC goes to
    TrainerServicer (servicer.py)."""

    @log_init_errors
    async def __init__(  # type: ignore[misc]  # Serve (Ray actors) awaits an async constructor
        self, config: dict[str, Any], run_dir: str, extras: dict[str, Any] | None = None
    ) -> None:
        clock = StartupClock("trainer")
        cfg = MeshConfig.model_validate(config)
        configure_logging("trainer", json=True, trainer_id=cfg.trainer_service.trainer_id)
        set_niceness(cfg.tuning.nice.trainer, key="tuning.nice.trainer")
        # Every client this replica makes (coordinator, param server) sends the trainer token.
        serve_replica_security(cfg, "trainer", "trainer")
        extras = extras or {}
        self._replica = str(getattr(getattr(serve.get_replica_context(), "replica_id", None), "unique_id", ""))
        # Ranks `meshrl train` asked for before Serve started are this replica's if it is the
        # first to claim them; else (a replica replacing a failed one, `serve deploy`) this module,
        # which does not import torch, asks for them before the replica's own imports (the
        # factory's, seconds), which their spawn and imports overlap.
        given: SpawnedRanks | None = extras.pop("ranks", None)
        if given is not None and await given.claim(self._replica or uuid.uuid4().hex):
            ranks = given
            clock.mark("ranks_claimed")
        else:
            ranks = spawn_for(cfg)
            clock.mark("ranks_requested")
        try:
            from .factory import build_trainer
        except BaseException:
            ranks.kill()
            raise
        self.parts: TrainerParts = await build_trainer(
            cfg, run_dir, algorithm=extras.get("algorithm"), publisher=extras.get("publisher"),
            model_init=extras.get("model_init"), clock=clock, ranks=ranks, session=extras.get("session", ""),
        )
        self._servicer = self.parts.servicer
        self._task = asyncio.get_running_loop().create_task(self.parts.loop.run())
        self._metrics = ReplicaMetrics(trainer_metrics.FAMILIES)
        self._metrics_task = export_periodically(
            "trainer", lambda: trainer_metrics.export(self._metrics, self.parts.loop.status()))
        clock.mark("ready")

    async def status(self) -> trainer_pb2.GetTrainerStatusResponse:
        """GetTrainerStatus's answer and this replica's id, for handle calls (`meshrl train` polls it)."""
        status = self.parts.servicer.status()
        status.replica = self._replica
        return status

    def check_health(self) -> None:
        # a loop that ended in a CancelledError from an inner call (grpc.aio) is a cancelled task
        if self._task.done() and (self._task.cancelled() or self._task.exception() is not None):
            raise RuntimeError(f"trainer loop failed: {self.parts.loop.error}")

    async def __del__(self) -> None:
        self._metrics_task.cancel()
        self._task.cancel()
        await self.parts.close()


def deployment_options(app: AppDeployConfig) -> dict[str, Any]:
    """Serve options of the trainer replica from `serve.trainer` (always one replica: the rank
    actors take the training devices, the replica only drives them)."""
    actor = app.ray_actor_options()
    return {"ray_actor_options": actor, "max_ongoing_requests": app.max_ongoing_requests, "num_replicas": 1}


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder: args = {config: dict, run_dir: str} plus, from Python only,
    `algorithm`, `publisher` and `model_init` objects (tests; a param-server publisher) and
    `ranks` (`meshrl train`: rank actors it spawned before Serve started, `ranks.spawn_for`), and
    `session` (the run's, as the coordinator's: resume_mode=disable goes back to step 0 once per
    session, so a replica Serve restarts goes on)."""
    cfg = MeshConfig.model_validate(args.get("config", {}))
    extras = {k: args[k] for k in ("algorithm", "publisher", "model_init", "ranks", "session") if args.get(k) is not None}
    deployment = TrainerDeployment.options(**deployment_options(cfg.serve.trainer))  # type: ignore[attr-defined]
    return deployment.bind(cfg.model_dump(mode="json"), str(args["run_dir"]), extras or None)  # type: ignore[no-any-return]
