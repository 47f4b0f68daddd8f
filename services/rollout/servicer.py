"""RolloutService over gRPC: proto in → worker/engine call → proto out (or a status code).
Runs under Ray Serve's gRPC proxy (deployment.py) and on a plain grpc.aio server (tests)."""

from __future__ import annotations

from typing import Any

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.grpc_util import rpc_method

from . import convert
from .worker import RolloutWorker


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Thin shim over a RolloutWorker. `default_sampling` fills a Generate request that carries
    no sampling (max_tokens == 0): validation sampling (actor_rollout_ref.rollout.val_kwargs)."""

    def __init__(self, worker: RolloutWorker, default_sampling: common_pb2.SamplingParams, *, max_n: int = 1024) -> None:
        self.worker = worker
        self.default_sampling = default_sampling
        self.max_n = max_n

    @rpc_method()
    async def Generate(self, request: rollout_pb2.GenerateRequest, context: Any) -> rollout_pb2.GenerateResponse:
        if not request.HasField("prompt"):
            raise InvalidArgument("prompt", "missing")
        params = request.sampling if request.sampling.max_tokens else self.default_sampling
        spec = convert.sampling_spec(params)
        if spec.n > self.max_n:
            raise InvalidArgument("sampling.n", f"{spec.n} samples in one Generate; at most {self.max_n}")
        if request.score and self.worker.scorer is None:
            raise FailedPrecondition("this replica has no reward scorer; call Generate with score=false")
        group = await self.worker.generate_group(
            request.prompt, spec, request_id=request.request_id or None, lease_id=request.request_id, score=request.score
        )
        assert group is not None
        return rollout_pb2.GenerateResponse(group=group, policy_version=self.worker.engine.version)

    @rpc_method()
    async def UpdateWeights(
        self, request: rollout_pb2.UpdateWeightsRequest, context: Any
    ) -> rollout_pb2.UpdateWeightsResponse:
        if not request.HasField("weights"):
            raise InvalidArgument("weights", "missing (the WeightsRef of the version to load)")
        if self.worker.fetcher is None:
            raise FailedPrecondition(
                "this replica has no weight fetcher; set rollout_worker.fetch_weights_from_param_server=true"
            )
        load_s = await self.worker.update_weights(request.weights)
        return rollout_pb2.UpdateWeightsResponse(policy_version=self.worker.engine.version, load_s=load_s)

    @rpc_method()
    async def GetRolloutStatus(
        self, request: rollout_pb2.GetRolloutStatusRequest, context: Any
    ) -> rollout_pb2.GetRolloutStatusResponse:
        return self.worker.status()

    @rpc_method()
    async def Drain(self, request: rollout_pb2.DrainRequest, context: Any) -> rollout_pb2.DrainResponse:
        returned, finished = await self.worker.drain(request.finish_in_flight)
        return rollout_pb2.DrainResponse(returned_leases=returned, finished_groups=finished)
