"""What every transport shares: the publisher/fetcher shapes, deadlines, bucket planning.

Shapes (structural: the trainer and rollout define the same Protocols on their side):

    publisher.publish(version, buckets) -> WeightsRef    # export_weights(bucket_bytes): plain or async iterable
    fetcher.fetch(ref) -> async iterator of [(hf_name, tensor), ...]

Fetcher contract, the same for every transport: buckets come out verified against the manifest;
the tensors of a bucket are valid until the next bucket is requested (a fetcher may reuse their
memory: copy what you keep, as engine `load_weights` does); a fetch either yields every bucket or
raises (DeadlineExceeded for a stuck peer, DataLoss when a bucket stays corrupt after
`max_fetch_attempts`). Breaking out of the iteration early is allowed and releases what it held.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from meshrl.v1 import common_pb2
from services.common.errors import DeadlineExceeded

from ..layout import BucketMeta, Manifest, TensorMeta, build_manifest, group_by_bytes, plan_bucket

Bucket = list[tuple[str, torch.Tensor]]
Buckets = Iterable[Bucket] | AsyncIterable[Bucket]


@runtime_checkable
class WeightPublisher(Protocol):
    async def publish(self, version: int, buckets: Buckets) -> common_pb2.WeightsRef: ...


@runtime_checkable
class WeightFetcher(Protocol):
    def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Bucket]: ...


class Deadline:
    """A monotonic deadline with messages that say what was being waited for."""

    def __init__(self, timeout_s: float, what: str) -> None:
        self.timeout_s = timeout_s
        self.what = what
        self.end = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def check(self, doing: str) -> float:
        """Remaining seconds; raises DeadlineExceeded when none are left."""
        left = self.remaining()
        if left <= 0:
            raise DeadlineExceeded(f"{self.what}: {doing} did not finish within the {self.timeout_s:.0f}s deadline")
        return left

    def stalled(self, doing: str, stall_s: float) -> DeadlineExceeded:
        if self.remaining() <= 0:
            return DeadlineExceeded(
                f"{self.what}: {doing} did not finish within the {self.timeout_s:.0f}s deadline (the peer is stuck, "
                "gone or too slow)"
            )
        return DeadlineExceeded(f"{self.what}: no progress for {stall_s:.0f}s while {doing} (the peer is stuck or gone)")


@dataclass
class PlannedBucket:
    """One bucket with its layout (tensors in input order, metas with offsets)."""

    index: int
    named: Bucket
    metas: list[TensorMeta]
    nbytes: int


async def iterate(buckets: Buckets) -> AsyncIterator[Bucket]:
    """Plain and async bucket iterables alike."""
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
    async for _ in iterate(buckets):
        count += 1
    return count


async def split_buckets(buckets: Buckets, max_bytes: int) -> AsyncIterator[Bucket]:
    """Each bucket as runs of its tensors (in order) of at most `max_bytes`, a larger tensor alone:
    a transport's own unit on the wire, whatever size the trainer gathers buckets in."""
    async for bucket in iterate(buckets):
        for run in group_by_bytes(bucket, max_bytes):
            yield run


async def plan_buckets(buckets: Buckets) -> AsyncIterator[PlannedBucket]:
    """Lay out buckets as they come (lazily: export_weights gathers as it goes; a plain or an
    async iterable). Empty input buckets are skipped."""
    index = 0
    async for named in iterate(buckets):
        if not named:
            continue
        metas, nbytes = plan_bucket(index, named)
        yield PlannedBucket(index, list(named), metas, nbytes)
        index += 1


class ManifestBuilder:
    def __init__(self, policy_version: int) -> None:
        self.policy_version = policy_version
        self.tensors: list[TensorMeta] = []
        self.buckets: list[BucketMeta] = []

    def add(self, bucket: PlannedBucket, fingerprint: str, sha256: str = "") -> BucketMeta:
        meta = BucketMeta(index=bucket.index, nbytes=bucket.nbytes, fingerprint=fingerprint, sha256=sha256)
        self.tensors.extend(bucket.metas)
        self.buckets.append(meta)
        return meta

    def build(self, transports: Iterable[str]) -> Manifest:
        return build_manifest(self.policy_version, self.tensors, self.buckets, created_unix_s=time.time(),
                              transports=transports)


def weights_ref(m: Manifest, address: str) -> common_pb2.WeightsRef:
    return common_pb2.WeightsRef(
        policy_version=m.policy_version, param_server_address=address,
        manifest_checksum=m.checksum, total_bytes=m.total_bytes,
    )


class ReusableBuffers:
    """A few host byte buffers handed out round-robin and grown on demand (fresh pages are slow;
    a steady stream of same-sized buckets reuses the same memory)."""

    def __init__(self, count: int, device: torch.device | str = "cpu", pin: bool = False) -> None:
        self._bufs: list[torch.Tensor | None] = [None] * count
        self._next = 0
        self.device = torch.device(device)
        self.pin = pin

    def get(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._bufs[slot]
        if buf is None or buf.numel() < nbytes:
            buf = None
            self._bufs[slot] = None
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device,
                              pin_memory=self.pin and self.device.type == "cpu")
            self._bufs[slot] = buf
        return buf[:nbytes]

    def next(self, nbytes: int) -> torch.Tensor:
        slot = self._next
        self._next = (self._next + 1) % len(self._bufs)
        return self.get(slot, nbytes)

    def clear(self) -> None:
        self._bufs = [None] * len(self._bufs)


def check_against_manifest(manifest: Manifest, ref: common_pb2.WeightsRef, where: str) -> None:
    """The manifest a fetcher got must be the one the ref names (a negative version in the ref
    means "the newest", for a consumer starting cold)."""
    from services.common.errors import DataLoss, FailedPrecondition

    if ref.policy_version >= 0 and manifest.policy_version != ref.policy_version:
        raise FailedPrecondition(f"{where}: asked version {ref.policy_version}, got {manifest.policy_version}")
    if ref.manifest_checksum and manifest.checksum != ref.manifest_checksum:
        raise DataLoss(
            f"{where}: version {ref.policy_version} has manifest {manifest.checksum[:16]}…, the ref names "
            f"{ref.manifest_checksum[:16]}… (the version was republished with other content?)"
        )
