"""The reward service's value objects: what is scored (Sample), what comes back (Score), and the
contract of a remote scorer. Plain Python, no protobuf (convert.py maps them to meshrl.v1)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Sample:
    """One response to score (a ScoreItem, decoded)."""

    item_id: str
    data_source: str
    response: str
    ground_truth: str = ""
    prompt: str = ""
    response_token_ids: Sequence[int] = ()
    extra_info: Mapping[str, Any] = field(default_factory=dict)
    policy_version: int = 0
    max_response_length: int = 0
    """0: the run's data.max_response_length."""
    truncated: bool = False

    @property
    def response_length(self) -> int:
        """Response length in tokens (what DAPO's overlong shaping measures)."""
        return len(self.response_token_ids)


@dataclass(frozen=True)
class Score:
    """The reward of one Sample. `score` is what the trainer uses; `metrics` are named signals for
    logging and filtering (acc, format, overlong_reward, timeout ...)."""

    item_id: str
    score: float
    metrics: Mapping[str, float] = field(default_factory=dict)


class RemoteScorer(Protocol):
    """A scorer behind the network (endpoints.EndpointClient). `score` returns one Score per
    sample, in order, or raises a MeshError; it may wait (retries, circuit breaker) but never
    returns a made-up score."""

    name: str

    async def score(self, samples: Sequence[Sample]) -> list[Score]: ...

    def status(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...
