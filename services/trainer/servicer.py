"""TrainerService over gRPC: inspection (GetTrainerStatus) and operator checkpoints
(SaveCheckpoint, which waits until the checkpoint after the current step is durable)."""

from __future__ import annotations

import asyncio
from typing import Any

from meshrl.v1 import trainer_pb2, trainer_pb2_grpc
from services.common.auth import Authorizer
from services.common.errors import DeadlineExceeded
from services.common.grpc_util import rpc_method

from .core import TrainerLoop


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """Thin shim over a TrainerLoop. Both RPCs are the operator role's (services/common/auth.py);
    `auth` holds the tokens checked behind Serve's proxy."""

    def __init__(
        self, loop: TrainerLoop, *, trainer_id: str, engine: str, auth: Authorizer | None = None,
        checkpoint_timeout_s: float = 3600.0,
    ) -> None:
        self.loop = loop
        self.trainer_id = trainer_id
        self.engine = engine
        self.auth = auth
        self.checkpoint_timeout_s = checkpoint_timeout_s

    @rpc_method()
    async def GetTrainerStatus(
        self, request: trainer_pb2.GetTrainerStatusRequest, context: Any
    ) -> trainer_pb2.GetTrainerStatusResponse:
        return self.status()

    def status(self) -> trainer_pb2.GetTrainerStatusResponse:
        """GetTrainerStatus's answer (also the deployment's handle call)."""
        st = self.loop.status()
        st.trainer_id, st.engine = self.trainer_id, self.engine
        return st

    @rpc_method()
    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: Any
    ) -> trainer_pb2.SaveCheckpointResponse:
        try:
            step, path = await asyncio.wait_for(self.loop.request_checkpoint(), timeout=self.checkpoint_timeout_s)
        except TimeoutError:
            raise DeadlineExceeded(f"no checkpoint within {self.checkpoint_timeout_s} s") from None
        return trainer_pb2.SaveCheckpointResponse(step=step, path=path)
