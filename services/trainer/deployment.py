"""The trainer as a Ray Serve application: one replica drives one training group.

    app = build_app(cfg, run_dir)            # serve.run(app, name="trainer")

The replica builds the rank actors and the loop in its constructor, then runs the loop as a task
on its event loop; TrainerService RPCs (Serve's gRPC ingress) and handle calls read its status.
A loop that failed makes `check_health` raise, so Serve restarts the replica, which resumes from
the newest checkpoint.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from ray import serve

from meshrl.v1 import trainer_pb2
from services.common.config import MeshConfig
from services.common.grpc_util import LocalContext
from services.common.logging import configure_logging, get_logger

from .core import Algorithm
from .factory import TrainerParts, build_trainer
from .publisher import WeightPublisher

log = get_logger(__name__)

GRPC_SERVICER = "meshrl.v1.trainer_pb2_grpc.add_TrainerServiceServicer_to_server"


class TrainerDeployment:
    """Serve shim over services.trainer.factory.build_trainer (see the module docstring)."""

    async def __init__(  # type: ignore[misc]  # Serve (Ray actors) awaits an async constructor
        self,
        config: dict[str, Any],
        run_dir: str,
        algorithm: Algorithm | None = None,
        publisher: WeightPublisher | None = None,
        model_init: Callable[[], Any] | None = None,
    ) -> None:
        cfg = MeshConfig.model_validate(config)
        configure_logging("trainer", trainer_id=cfg.trainer_service.trainer_id)
        self.parts: TrainerParts = await build_trainer(
            cfg, run_dir, algorithm=algorithm, publisher=publisher, model_init=model_init
        )
        self._task = asyncio.get_running_loop().create_task(self.parts.loop.run())

    async def GetTrainerStatus(
        self, request: trainer_pb2.GetTrainerStatusRequest, grpc_context: Any = None
    ) -> trainer_pb2.GetTrainerStatusResponse:
        return await self.parts.servicer.GetTrainerStatus(request, grpc_context or LocalContext())  # type: ignore[no-any-return]

    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, grpc_context: Any = None
    ) -> trainer_pb2.SaveCheckpointResponse:
        return await self.parts.servicer.SaveCheckpoint(request, grpc_context or LocalContext())  # type: ignore[no-any-return]

    async def status(self) -> dict[str, Any]:
        """The loop's status (handle calls)."""
        return self.parts.loop.status()

    def check_health(self) -> None:
        if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
            raise RuntimeError(f"trainer loop failed: {self.parts.loop.error}")

    async def __del__(self) -> None:
        self._task.cancel()
        await self.parts.close()


def build_app(
    cfg: MeshConfig,
    run_dir: str | os.PathLike[str],
    *,
    algorithm: Algorithm | None = None,
    publisher: WeightPublisher | None = None,
    model_init: Callable[[], Any] | None = None,
) -> Any:
    """The bound trainer application for serve.run."""
    d = cfg.serve.trainer
    options: dict[str, Any] = {"num_cpus": d.num_cpus}
    if d.num_gpus:
        options["num_gpus"] = d.num_gpus
    if d.resources:
        options["resources"] = dict(d.resources)
    if d.runtime_env:
        options["runtime_env"] = dict(d.runtime_env)
    deployment: Any = serve.deployment(TrainerDeployment)
    deployment = deployment.options(
        name="Trainer", num_replicas=1, ray_actor_options=options, max_ongoing_requests=d.max_ongoing_requests,
    )
    return deployment.bind(cfg.model_dump(mode="json"), str(run_dir), algorithm, publisher, model_init)
