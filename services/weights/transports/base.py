"""What every transport shares: deadlines, bucket planning, manifests. The publisher/fetcher
contract is services/weights/protocols.py."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from meshrl.v1 import common_pb2
from services.common.errors import DataLoss, DeadlineExceeded, FailedPrecondition

from ..adapter import AdapterSpec, split_descriptor
from ..layout import BucketMeta, Manifest, TensorMeta, build_manifest, group_by_bytes, plan_bucket
from ..packing import PackedBucket, known_fingerprint
from ..protocols import Bucket, Buckets, iterate_buckets


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
    packed: PackedBucket | None = None
    """The bucket as its packer left it (packing.py: one buffer, its fingerprint, maybe its Ray
    object), when its tensors are still that buffer in this layout; None otherwise."""

    @property
    def fingerprint(self) -> str | None:
        """The packer's fingerprint (None: the transport reads the bytes for one)."""
        return None if self.packed is None else self.packed.fingerprint


async def split_buckets(buckets: Buckets, max_bytes: int) -> AsyncIterator[Bucket]:
    """Each bucket as runs of its tensors (in order) of at most `max_bytes`, a larger tensor alone:
    a transport's own unit on the wire, whatever size the trainer gathers buckets in."""
    async for bucket in iterate_buckets(buckets):
        for run in group_by_bytes(bucket, max_bytes):
            yield run


async def plan_buckets(buckets: Buckets) -> AsyncIterator[PlannedBucket]:
    """Lay out buckets as they come (lazily: export_weights gathers as it goes; a plain or an
    async iterable). Empty input buckets are skipped."""
    index = 0
    async for named in iterate_buckets(buckets):
        if not named:
            continue
        metas, nbytes = plan_bucket(index, named)
        packed = named if isinstance(named, PackedBucket) and known_fingerprint(named, metas, nbytes) else None
        yield PlannedBucket(index, list(named), metas, nbytes, packed)
        index += 1


class ManifestBuilder:
    def __init__(self, policy_version: int) -> None:
        self.policy_version = policy_version
        self.tensors: list[TensorMeta] = []
        self.buckets: list[BucketMeta] = []
        self.adapter: AdapterSpec | None = None

    def note(self, bucket: PlannedBucket) -> None:
        """Read what the manifest says about the version from a bucket's tensors, for callers
        that `add` buckets after releasing them: an adapter-only version opens with its
        descriptor (adapter.py)."""
        if bucket.index == 0 and bucket.named:
            self.adapter = split_descriptor(bucket.named)[0]

    def add(self, bucket: PlannedBucket, fingerprint: str, sha256: str = "") -> BucketMeta:
        meta = BucketMeta(index=bucket.index, nbytes=bucket.nbytes, fingerprint=fingerprint, sha256=sha256)
        self.note(bucket)
        self.tensors.extend(bucket.metas)
        self.buckets.append(meta)
        return meta

    def build(self, transports: Iterable[str]) -> Manifest:
        return build_manifest(self.policy_version, self.tensors, self.buckets, created_unix_s=time.time(),
                              transports=transports, adapter=self.adapter)


def check_against_manifest(manifest: Manifest, ref: common_pb2.WeightsRef, where: str) -> None:
    """The manifest a fetcher got must be the one the ref names (a negative version in the ref
    means "the newest", for a consumer starting cold)."""
    if ref.policy_version >= 0 and manifest.policy_version != ref.policy_version:
        raise FailedPrecondition(f"{where}: asked version {ref.policy_version}, got {manifest.policy_version}")
    if ref.manifest_checksum and manifest.checksum != ref.manifest_checksum:
        raise DataLoss(
            f"{where}: version {ref.policy_version} has manifest {manifest.checksum[:16]}…, the ref names "
            f"{ref.manifest_checksum[:16]}… (the version was republished with other content?)"
        )
