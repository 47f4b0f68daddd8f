"""Weight versions kept in this process: tests and single-process runs, where no bytes travel.

- InProcessPublisher (the trainer's `trainer_service.publisher=in_process`): keeps the newest
  versions as name -> tensor and calls registered consumers with each new one.
- InMemoryWeightStore (a rollout's fetcher in tests): `publish(version, named_tensors)` keeps
  buckets in a dict; `fetch(ref)` reads them back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.v1 import common_pb2
from services.common.errors import ConfigError, FailedPrecondition, NotFound

from .layout import group_by_bytes, tensor_nbytes
from .protocols import Bucket, Buckets, iterate_buckets


def tensor_digest(h: Any, name: str, tensor: torch.Tensor) -> None:
    """Feed name, dtype, shape and bytes of a tensor into a hashlib object."""
    t = tensor.detach().contiguous().cpu()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # 0-dim too


def model_named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A model's weights by HF name, tied aliases once (what a trainer publishes)."""
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out.append((name, t.detach().clone()))
    return out


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
        async for bucket in iterate_buckets(buckets):
            for name, tensor in bucket:
                if name in weights:
                    raise FailedPrecondition(f"weight {name!r} published twice in version {version}")
                tensor_digest(h, name, tensor)
                weights[name] = tensor
                total += tensor_nbytes(tensor)
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


class InMemoryWeightStore:
    """Versions held in this process, fetched back as buckets (a WeightFetcher for tests)."""

    def __init__(self, bucket_bytes: int = 1 << 20) -> None:
        self.bucket_bytes = bucket_bytes
        self._versions: dict[int, list[Bucket]] = {}

    def publish(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> common_pb2.WeightsRef:
        buckets = list(group_by_bytes(((n, t.detach().cpu().clone()) for n, t in named), self.bucket_bytes))
        self._versions[version] = buckets
        total = sum(tensor_nbytes(t) for b in buckets for _, t in b)
        return common_pb2.WeightsRef(policy_version=version, total_bytes=total)

    def versions(self) -> list[int]:
        return sorted(self._versions)

    async def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Bucket]:
        buckets = self._versions.get(ref.policy_version)
        if buckets is None:
            raise NotFound(f"policy version {ref.policy_version} is not published (have {self.versions()})")
        for b in buckets:
            yield list(b)
