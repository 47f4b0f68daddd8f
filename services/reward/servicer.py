"""RewardService over gRPC: proto in -> validate -> pipeline -> proto out (or a status code).

The same servicer runs as a plain grpc.aio server (server.py) and inside the Serve deployment
(deployment.py), which passes its batched scoring function as `score_fn`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from meshrl.v1 import reward_pb2, reward_pb2_grpc
from services.common.auth import Authorizer
from services.common.grpc_util import rpc_method
from services.common.jsonutil import DEFAULT_MAX_DEPTH

from . import convert
from .core import RewardPipeline
from .samples import Sample, Score

ScoreFn = Callable[[Sequence[Sample]], Awaitable[list[Score]]]


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Thin shim over RewardPipeline. Score: one result per item, in request order."""

    def __init__(
        self, pipeline: RewardPipeline, *, max_items: int = 8192, score_fn: ScoreFn | None = None,
        max_json_depth: int = DEFAULT_MAX_DEPTH,
    ) -> None:
        self.pipeline = pipeline
        self.max_json_depth = max_json_depth
        self.auth: Authorizer | None = None
        self.max_items = max_items
        self.score_fn: ScoreFn = score_fn or pipeline.score

    async def score_request(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        """Score without a gRPC context (Serve handle calls, tests); raises MeshErrors."""
        samples = convert.samples_from_items(request.items, max_items=self.max_items, max_json_depth=self.max_json_depth)
        if not samples:
            return reward_pb2.ScoreResponse()
        self.pipeline.validate(samples)
        return convert.score_response(await self.score_fn(samples))

    @rpc_method()
    async def Score(self, request: reward_pb2.ScoreRequest, context: Any) -> reward_pb2.ScoreResponse:
        return await self.score_request(request)
