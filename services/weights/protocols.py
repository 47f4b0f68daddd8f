"""The contract between whoever produces weight versions (the trainer's engines and publisher) and
whoever consumes them (rollout engines), whatever carries the bytes in between.

    publisher.publish(version, buckets) -> WeightsRef     # buckets: engine.export_weights(bucket_bytes)
    fetcher.fetch(ref) -> async iterator of Bucket        # engine.load_weights(version, buckets)

A `Bucket` is a list of (Hugging Face name, tensor): names are HF names so that any engine can
load them. A producer yields buckets of at most `update_weights_bucket_megabytes` each (a larger
tensor travels alone), as a plain or an async iterable (`Buckets`).

Publisher contract: the version is durable/servable before `publish` returns (the coordinator
tells rollouts about it right after).

Fetcher contract, the same for every transport: buckets come out verified against the manifest;
the tensors of a bucket are valid until the next bucket is requested (a fetcher may reuse their
memory: copy what you keep, as engine `load_weights` does); a fetch either yields every bucket or
raises (NotFound for a version no longer retained, DeadlineExceeded for a stuck peer, DataLoss when
a bucket stays corrupt after `max_fetch_attempts`). Breaking out of the iteration early is allowed
and releases what it held.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

from meshrl.v1 import common_pb2

if TYPE_CHECKING:  # torch costs seconds at import; the driver and light services import this module
    import torch

Bucket: TypeAlias = list[tuple[str, "torch.Tensor"]]
"""(Hugging Face parameter name, tensor) pairs that travel together."""
Buckets = Iterable[Bucket] | AsyncIterable[Bucket]
"""What `publish` takes: a plain or an async iterable of buckets (consumed once, lazily)."""


@runtime_checkable
class WeightPublisher(Protocol):
    """Makes weight versions available to consumers; see the module docstring for the contract."""

    async def publish(self, version: int, buckets: Buckets) -> common_pb2.WeightsRef: ...


@runtime_checkable
class WeightFetcher(Protocol):
    """Source of published weights, by version; see the module docstring for the contract."""

    def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Bucket]: ...


async def iterate_buckets(buckets: Buckets) -> AsyncIterator[Bucket]:
    """Plain and async bucket iterables alike, as an async iterator (what `load_weights` takes)."""
    if isinstance(buckets, AsyncIterable):
        async for bucket in buckets:
            yield bucket
    else:
        for bucket in buckets:
            yield bucket


async def drain(buckets: Buckets) -> int:
    """Read buckets to the end without keeping them (an export every rank must finish even when
    nothing is sent); returns how many there were."""
    count = 0
    async for _ in iterate_buckets(buckets):
        count += 1
    return count
