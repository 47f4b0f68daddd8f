"""How the trainer chooses the publisher that hands each new weight version to the mesh.

    ref = await publisher.publish(version, buckets)     # then CommitVersion(ref) on the coordinator

The contract (buckets, durability before `publish` returns) is services/weights/protocols.py;
the publishers themselves are services/weights (the param server's transports, and
`in_process` for tests and single-process runs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.errors import ConfigError
from services.weights import WeightPublisher


class SentAgain(Protocol):
    """Whether the version sent last must go again (services.weights.transports.collective.SendAgainProbe)."""

    async def __call__(self, version: int) -> bool: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class RankZeroPublisher:
    """The publisher is built and run on rank 0 of the training group, not where the loop runs:
    the collective transports (nccl / hccl, and gloo, their CPU twin) broadcast from the rank's
    own device. `make` (picklable) builds the real publisher there (TrainGroup.start_sender); the
    loop then publishes with TrainGroup.publish_weights."""

    make: Callable[[], WeightPublisher]
    every_rank: Callable[[int], WeightPublisher] | None = None
    """Set (`param_server.collective_sharded`): every rank r builds `every_rank(r)` instead and
    sends the rows it owns (TrainEngine.export_shards); the receivers rebuild whole tensors."""
    wanted_again: SentAgain | None = None
    """Asked, in the loop's process, whether the version sent last must be sent again (a rollout
    rank that replaced one waits for it: collective.SendAgainProbe)."""

    async def close(self) -> None:
        if self.wanted_again is not None:
            await self.wanted_again.close()


_PUBLISHERS: dict[str, str] = {"in_process": "services.weights.in_process:InProcessPublisher"}


def register_publisher(name: str, import_path: str) -> None:
    """Make `trainer_service.publisher=name` build `module:Class` (called with `**kwargs`)."""
    _PUBLISHERS[name] = import_path


def build_publisher(name: str, **kwargs: Any) -> WeightPublisher:
    """The publisher registered as `name`, constructed with `kwargs`."""
    if name not in _PUBLISHERS:
        raise ConfigError(f"trainer_service.publisher={name!r} is unknown; use one of {sorted(_PUBLISHERS)}")
    module, _, cls = _PUBLISHERS[name].partition(":")
    publisher = getattr(importlib.import_module(module), cls)(**kwargs)
    assert isinstance(publisher, WeightPublisher), f"{_PUBLISHERS[name]} does not implement WeightPublisher"
    return publisher  # type: ignore[no-any-return]
