"""Client of an external meshrl.v1.RewardService: the items are cut into chunks of `batch_size`,
each chunk is one Score call through the shared resilient endpoint client
(services/common/endpoints.py: deadlines, bounded retries with backoff and jitter, a circuit
breaker, TLS and a token).

When the endpoint is down its breaker opens and the items *wait* (counted as `waiting_items` in
`status()`); Score fails with UNAVAILABLE only after `max_wait_s` (null: never). Scores are never
invented. Delivery is at-least-once: a call that timed out may have been scored by the endpoint
before it is sent again, so Score must be a pure function of the item (it is, for any sane reward).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from meshrl.v1 import reward_pb2
from services.common.config.reward import RewardEndpointConfig
from services.common.endpoints import ResilientEndpoint

from . import convert
from .samples import Sample, Score

SERVICE = reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name


class EndpointClient:
    """A RemoteScorer over gRPC for one `reward.endpoints[i]` (see module docstring)."""

    def __init__(
        self,
        cfg: RewardEndpointConfig,
        *,
        index: int = 0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.name = cfg.label
        self.source = f"reward endpoint {cfg.label!r} ({cfg.address}, reward.endpoints[{index}])"
        self.endpoint = ResilientEndpoint(
            cfg, source=self.source, service=SERVICE, payloads={"Score": "items"}, rng=rng, clock=clock
        )
        self.items_scored = 0

    @property
    def breaker(self) -> Any:
        return self.endpoint.breaker

    async def score(self, samples: Sequence[Sample]) -> list[Score]:
        """Scores for `samples`, in order (see module docstring for waiting and errors)."""
        n = self.cfg.batch_size
        chunks = [list(samples[i : i + n]) for i in range(0, len(samples), n)]
        tasks = [asyncio.ensure_future(self._score_chunk(c)) for c in chunks]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # one chunk failed (or we were cancelled): stop the others waiting
                t.cancel()
            raise
        scores = [s for chunk in results for s in chunk]
        # counted once the call succeeds: a refused call's items are scored again (one at a time,
        # core._score_remote), and its chunks already scored must not count twice
        self.items_scored += len(scores)
        return scores

    async def _score_chunk(self, samples: list[Sample]) -> list[Score]:
        request = reward_pb2.ScoreRequest(items=[convert.item_from_sample(s) for s in samples])

        def check(reply: reward_pb2.ScoreResponse) -> list[Score]:
            return convert.scores_from_response(reply, samples, self.source)

        return await self.endpoint.call("Score", request, reward_pb2.ScoreResponse, check, units=len(samples))

    def status(self) -> dict[str, Any]:
        st = self.endpoint.status()
        return {
            "name": st["name"],
            "address": st["address"],
            "state": st["state"],
            "consecutive_failures": st["consecutive_failures"],
            "down_for_s": st["down_for_s"],
            "times_opened": st["times_opened"],
            "waiting_items": st["waiting"],
            "calls": st["calls"],
            "failed_attempts": st["failed_attempts"],
            "retries": st["retries"],
            "items_scored": self.items_scored,
            "last_error": st["last_error"],
        }

    async def close(self) -> None:
        await self.endpoint.close()
