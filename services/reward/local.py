"""The reward pipeline as a Scorer in this process: no Ray, no server (tests, benchmarks, the
single-process baseline). Same contract as the scorers in client.py."""

from __future__ import annotations

from typing import Any

from meshrl.v1 import reward_pb2
from services.common.config import MeshConfig

from . import convert
from .factory import build_pipeline


class LocalScorer:
    """Scorer running the reward pipeline in this process (no Ray, no server). Use from one
    event loop; `close()` when done."""

    def __init__(self, cfg: MeshConfig) -> None:
        self.cfg = cfg
        self.pipeline = build_pipeline(cfg)
        self.max_items = cfg.reward.max_items_per_request

    async def __call__(self, items: list[reward_pb2.ScoreItem]) -> list[reward_pb2.ScoreResult]:
        samples = convert.samples_from_items(items, max_items=self.max_items)
        self.pipeline.validate(samples)
        scores = await self.pipeline.score(samples)
        return [convert.result_from_score(s) for s in scores]

    def status(self) -> dict[str, Any]:
        return self.pipeline.status()

    async def close(self) -> None:
        await self.pipeline.close()
