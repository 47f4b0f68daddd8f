"""How the trainer hands a new weight version to the rest of the mesh.

    ref = await publisher.publish(version, buckets)     # then CommitVersion(ref) on the coordinator

`buckets` yields lists of (Hugging Face name, full CPU tensor) of at most
`update_weights_bucket_megabytes` each (a larger tensor travels alone), as the training engine's
`export_weights` produces them; it may be a plain or an async iterable. A publisher must have
made the version durable/servable before `publish` returns: the coordinator tells rollouts about
it right after. The param server provides the networked publishers; `in_process` keeps versions
in this process (tests, single-process runs) and hands them to registered consumers.
"""

from __future__ import annotations

import hashlib
import importlib
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from meshrl.v1 import common_pb2
from services.common.errors import ConfigError, FailedPrecondition, NotFound

Bucket = list[tuple[str, torch.Tensor]]
Buckets = Iterable[Bucket] | AsyncIterable[Bucket]


@runtime_checkable
class WeightPublisher(Protocol):
    """Makes weight versions available; see the module docstring for the contract."""

    async def publish(self, version: int, buckets: Buckets) -> common_pb2.WeightsRef: ...


async def iter_buckets(buckets: Buckets) -> AsyncIterator[Bucket]:
    """Iterate plain and async bucket iterables alike."""
    if isinstance(buckets, AsyncIterable):
        async for bucket in buckets:
            yield bucket
    else:
        for bucket in buckets:
            yield bucket


def tensor_digest(h: Any, name: str, tensor: torch.Tensor) -> None:
    """Feed name, dtype, shape and bytes of a tensor into a hashlib object."""
    t = tensor.detach().contiguous().cpu()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


@dataclass(frozen=True)
class PublishedVersion:
    version: int
    weights: dict[str, torch.Tensor]
    ref: common_pb2.WeightsRef


Consumer = Callable[[PublishedVersion], Any]


class InProcessPublisher:
    """Keeps the newest `retain_versions` versions in memory and calls each registered consumer
    (sync or async) with every new version, in order."""

    def __init__(self, retain_versions: int = 2) -> None:
        if retain_versions < 1:
            raise ConfigError(f"param_server.retain_versions must be >= 1, got {retain_versions}")
        self.retain_versions = retain_versions
        self._versions: OrderedDict[int, PublishedVersion] = OrderedDict()
        self._consumers: list[Consumer] = []

    def subscribe(self, consumer: Consumer) -> None:
        self._consumers.append(consumer)

    async def publish(self, version: int, buckets: Buckets) -> common_pb2.WeightsRef:
        if self._versions and version <= next(reversed(self._versions)):
            raise FailedPrecondition(f"version {version} is not newer than {next(reversed(self._versions))}")
        h = hashlib.sha256()
        weights: dict[str, torch.Tensor] = {}
        total = 0
        async for bucket in iter_buckets(buckets):
            for name, tensor in bucket:
                if name in weights:
                    raise FailedPrecondition(f"weight {name!r} published twice in version {version}")
                tensor_digest(h, name, tensor)
                weights[name] = tensor
                total += tensor.numel() * tensor.element_size()
        ref = common_pb2.WeightsRef(policy_version=version, manifest_checksum=h.hexdigest(), total_bytes=total)
        published = PublishedVersion(version, weights, ref)
        self._versions[version] = published
        while len(self._versions) > self.retain_versions:
            self._versions.popitem(last=False)
        for consumer in self._consumers:
            result = consumer(published)
            if hasattr(result, "__await__"):
                await result
        return ref

    def get(self, version: int) -> PublishedVersion:
        try:
            return self._versions[version]
        except KeyError:
            raise NotFound(f"weight version {version} is not retained (have {list(self._versions)})") from None

    @property
    def versions(self) -> list[int]:
        return list(self._versions)


@dataclass(frozen=True)
class RankZeroPublisher:
    """The publisher is built and run on rank 0 of the training group, not where the loop runs:
    the collective transports (nccl / hccl, and gloo, their CPU twin) broadcast from the rank's
    own device. `make` (picklable) builds the real publisher there (TrainGroup.start_sender); the
    loop then publishes with TrainGroup.publish_weights."""

    make: Callable[[], WeightPublisher]


_PUBLISHERS: dict[str, str] = {"in_process": "services.trainer.publisher:InProcessPublisher"}


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
