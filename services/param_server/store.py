"""The versioned weight store: uploads, visibility, holds, retention. No Ray, no gRPC, no clock.

Every method takes `now` (seconds) where time matters, so tests drive time. All methods are called
from one thread (the server's event loop) except `Upload.write`, which copies and fingerprints a
chunk and may run in a worker thread: it touches only its own upload's buffers.

A version's life:

    begin_upload ──write/begin_bucket (chunks, any number)──▶ finish ──▶ visible
         │                                                      ▲
         └── register (manifest only: bytes travel elsewhere) ───┘
    visible ──(older than the newest `retain_versions`, no live hold, no open reader)──▶ evicted

A version is visible only when complete: every bucket received and verified against the
manifest. Holds (AcquireVersion) expire after `hold_ttl_s` unless renewed; an open reader
(a FetchWeights stream in progress) pins its version until it closes. Evicted host buffers go to
a small pool and back out to the next upload of the same size: fresh pages cost far more than
the copy into them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from services.common.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from services.common.logging import get_logger
from services.weights.layout import BucketMeta, Fingerprinter, Manifest, validate_manifest, verify_bucket

from .object_refs import immutable_refusal

log = get_logger(__name__)

GRPC_TRANSPORT = "grpc"
SEEN_BY_KEPT = 4


@dataclass(frozen=True)
class StoreSettings:
    retain_versions: int = 2
    """Newest complete versions always kept."""
    hold_ttl_s: float = 600.0
    """A hold not renewed for this long no longer pins its version."""
    stall_timeout_s: float = 60.0
    """An upload with no progress for this long may be replaced by a new upload of that version."""
    sha256: bool = False
    """Also verify sha256 of uploaded buckets when the publisher sent one."""
    pool_max_bytes: int = 8 << 30
    """Host bytes of evicted buffers kept for reuse."""
    max_upload_bytes: int = 1 << 40
    """Largest version one upload may announce or allocate."""
    max_holders_per_version: int = 4096
    """Consumers that may hold one version at once."""


@dataclass
class StoredVersion:
    manifest: Manifest
    buffers: list[torch.Tensor] | None
    """One uint8 host tensor per bucket (exactly nbytes long); None when bytes live elsewhere."""
    holds: dict[str, float] = field(default_factory=dict)
    """consumer_id -> hold expiry (seconds)."""
    readers: int = 0
    payload: object | None = None
    """Transport data the store does not interpret (e.g. Ray object refs)."""
    served: bool = False
    """Whether any consumer has loaded it (a hold or bytes). Until then it may be replaced:
    see `WeightStore._commit`. Set through `WeightStore._seen`."""
    seen_by: list[str] = field(default_factory=list)
    """Who loaded it first (at most SEEN_BY_KEPT entries), named when a republish is refused."""

    @property
    def policy_version(self) -> int:
        return self.manifest.policy_version

    def live_holders(self, now: float) -> int:
        return sum(1 for expiry in self.holds.values() if expiry > now)


class BufferPool:
    """Host byte buffers from evicted versions, handed out again for uploads of a similar size."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: list[torch.Tensor] = []

    @property
    def pooled_bytes(self) -> int:
        return sum(b.numel() for b in self._free)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly `nbytes` (a view of a pooled buffer when one fits)."""
        best = None
        for i, buf in enumerate(self._free):
            if nbytes <= buf.numel() <= 2 * nbytes + 4096 and (best is None or buf.numel() < self._free[best].numel()):
                best = i
        if best is not None:
            return self._free.pop(best)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        assert isinstance(base, torch.Tensor)
        if base.numel() == 0 or base.numel() > self.max_bytes:
            return
        self._free.append(base)
        while self.pooled_bytes > self.max_bytes:
            self._free.pop(0)


class _UploadBucket:
    def __init__(self, meta: BucketMeta | None, buffer: torch.Tensor, want_sha: bool) -> None:
        self.meta = meta
        self.buffer = buffer
        self.received = 0
        self.writing = False  # a chunk is being copied in (io thread): not the pool's until it ends
        self.fingerprint = Fingerprinter(buffer.numel())
        self.sha = hashlib.sha256() if want_sha else None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


class Upload:
    """One PublishWeights stream: buckets arrive in order, chunks in order within a bucket."""

    def __init__(self, store: WeightStore, policy_version: int, now: float) -> None:
        self.store = store
        self.policy_version = policy_version
        self.started = now
        self.last_activity = now
        self.manifest: Manifest | None = None
        self.buckets: list[_UploadBucket] = []
        self.done = False
        self.aborted = False

    def touch(self, now: float) -> None:
        self.last_activity = now

    def set_manifest(self, manifest: Manifest) -> None:
        if manifest.policy_version != self.policy_version:
            raise InvalidArgument(
                "manifest.policy_version", f"{manifest.policy_version} in a stream for version {self.policy_version}"
            )
        if self.manifest is not None:
            raise InvalidArgument("manifest", "sent twice in one stream")
        validate_manifest(manifest)
        self.store._check_size(manifest.total_bytes, "manifest.total_bytes")
        self.manifest = manifest

    def begin_bucket(self, meta: BucketMeta | None = None) -> None:
        """Open the next bucket. `meta` may be omitted when the manifest came first."""
        self._alive()
        index = len(self.buckets)
        if self.buckets and self.buckets[-1].received != self.buckets[-1].nbytes:
            last = self.buckets[-1]
            raise DataLoss(f"bucket {index - 1} ended after {last.received} of {last.nbytes} bytes")
        if meta is None:
            if self.manifest is None or index >= len(self.manifest.buckets):
                raise InvalidArgument("bucket", f"bucket {index} has no BucketMeta and no manifest describes it")
            meta = self.manifest.buckets[index]
        if meta.index != index:
            raise InvalidArgument("bucket.index", f"expected bucket {index}, got {meta.index}; send buckets in order")
        if self.manifest is not None and (index >= len(self.manifest.buckets) or self.manifest.buckets[index] != meta):
            raise InvalidArgument("bucket", f"bucket {index} disagrees with the manifest sent first")
        self.store._check_size(sum(b.nbytes for b in self.buckets) + meta.nbytes, f"bucket[{index}].nbytes")
        buffer = self.store.pool.take(meta.nbytes)
        self.buckets.append(_UploadBucket(meta, buffer, want_sha=self.store.settings.sha256 and bool(meta.sha256)))

    def _alive(self) -> None:
        if self.aborted:
            # DEADLINE_EXCEEDED, as the servicer answers a stream silent for stall_timeout_s: the
            # publisher sends the version again (TrainerLoop._republish retries transient errors
            # only; FAILED_PRECONDITION failed the trainer's loop over a slow copy).
            raise DeadlineExceeded(
                f"the upload of version {self.policy_version} was dropped (stalled longer than "
                "param_server.stall_timeout_s, or replaced by a newer upload of that version); publish it again"
            )

    def check_chunk(self, bucket_index: int, offset: int, size: int) -> _UploadBucket:
        """Validate a chunk's place (on the loop thread) before `write` copies it."""
        self._alive()
        while len(self.buckets) <= bucket_index:
            self.begin_bucket()  # from the manifest sent first; raises without one
        if bucket_index != len(self.buckets) - 1:
            raise InvalidArgument("chunk.bucket_index", f"got {bucket_index}, expected {len(self.buckets) - 1}")
        cur = self.buckets[-1]
        if offset != cur.received:
            raise InvalidArgument("chunk.offset", f"bucket {bucket_index}: got offset {offset}, expected {cur.received}")
        if offset + size > cur.nbytes:
            raise InvalidArgument("chunk.data", f"bucket {bucket_index}: chunk runs past {cur.nbytes} bytes")
        cur.received += size
        cur.writing = True  # until write() ends (one chunk at a time per upload)
        return cur

    @staticmethod
    def write(bucket: _UploadBucket, offset: int, data: object) -> None:
        """Copy and fingerprint one chunk (thread-safe w.r.t. other uploads; releases the GIL)."""
        try:
            mv = memoryview(data).cast("B")  # type: ignore[arg-type]
            if len(mv):
                bucket.buffer.numpy()[offset : offset + len(mv)] = np.frombuffer(mv, dtype=np.uint8)
            bucket.fingerprint.update(offset, mv)
            if bucket.sha is not None:
                bucket.sha.update(mv)
        finally:
            bucket.writing = False

    def finish(self, now: float) -> Manifest:
        """Verify everything and make the version visible. Returns the stored manifest."""
        self._alive()
        if self.manifest is None:
            raise InvalidArgument("manifest", "the stream ended without a manifest")
        m = self.manifest
        if not self.buckets and m.total_bytes:
            raise InvalidArgument("chunk", "no bytes were sent; to register a version whose bytes travel "
                                  "another way, list that transport (not grpc) in manifest.transports")
        while len(self.buckets) < len(m.buckets):
            missing = m.buckets[len(self.buckets)]
            if missing.nbytes:
                raise DataLoss(f"version {m.policy_version}: the stream ended before bucket {missing.index}")
            self.begin_bucket()  # empty buckets carry no chunks
        if len(self.buckets) != len(m.buckets):
            raise InvalidArgument("manifest.buckets", f"{len(self.buckets)} buckets were sent, the manifest lists {len(m.buckets)}")
        for b, expected in zip(self.buckets, m.buckets, strict=True):
            if b.meta != expected:
                raise InvalidArgument("manifest.buckets", f"bucket {expected.index} differs from its BucketMeta")
            verify_bucket(
                expected,
                fingerprint=b.fingerprint.hexdigest(),
                sha256=b.sha.hexdigest() if b.sha is not None else None,
                nbytes=b.received,
            )
        self.done = True
        buffers = [b.buffer for b in self.buckets]
        self.buckets = []
        if self.store._uploads.get(self.policy_version) is self:  # only its own entry (register leaves it)
            del self.store._uploads[self.policy_version]
        return self.store._commit(m.with_transports([GRPC_TRANSPORT]), buffers, now)

    def abort(self) -> None:
        if self.aborted:
            return
        self.aborted = True
        for b in self.buckets:
            # A buffer the io thread still copies into (the sweeper dropped a stalled upload
            # mid-write) stays out of the pool: the next upload to take it would get the late
            # bytes over its own, after its chunks were fingerprinted as they arrived.
            if not b.writing:
                self.store.pool.give(b.buffer)
        self.buckets = []
        if self.store._uploads.get(self.policy_version) is self:
            del self.store._uploads[self.policy_version]


class WeightStore:
    """Complete versions by policy version, plus uploads in progress."""

    def __init__(self, settings: StoreSettings, on_evict: Callable[[StoredVersion], None] | None = None) -> None:
        if settings.retain_versions < 1:
            raise InvalidArgument("param_server.retain_versions", "must be >= 1")
        self.settings = settings
        self.pool = BufferPool(settings.pool_max_bytes)
        self._versions: dict[int, StoredVersion] = {}
        self._uploads: dict[int, Upload] = {}
        self._on_evict = on_evict
        self.on_served: Callable[[StoredVersion], None] | None = None
        """Called once when a consumer first sees a version here: where its bytes live elsewhere
        (the object_store's refs actor) that place must refuse other content for it too."""
        self.evicted_total = 0

    # ---- writes ---------------------------------------------------------------------------------

    def _check_size(self, nbytes: int, field: str) -> None:
        """Refuse an upload that would exceed the per-version quota, before any memory is taken."""
        if nbytes > self.settings.max_upload_bytes:
            raise ResourceExhausted(
                f"{field}: {nbytes} bytes exceed the upload quota of {self.settings.max_upload_bytes} bytes "
                "(param_server.max_upload_mb)"
            )

    def begin_upload(self, policy_version: int, now: float) -> Upload:
        if policy_version < 0:
            raise InvalidArgument("manifest.policy_version", f"must be >= 0, got {policy_version}")
        pending = self._uploads.get(policy_version)
        if pending is not None:
            if now - pending.last_activity < self.settings.stall_timeout_s:
                # UNAVAILABLE: the slot frees within stall_timeout_s (the stream ends or goes
                # stale). Most often the other stream is the publisher's own attempt it gave up
                # on, whose cancellation has not reached this server yet; the trainer retries
                # transient errors with backoff (TrainerLoop._republish) and failed on any other.
                raise Unavailable(
                    f"version {policy_version} is being uploaded by another stream (last progress "
                    f"{now - pending.last_activity:.1f}s ago); wait for it or for param_server.stall_timeout_s"
                )
            pending.abort()
        upload = Upload(self, policy_version, now)
        self._uploads[policy_version] = upload
        return upload

    def register(self, manifest: Manifest, now: float, payload: object | None = None) -> Manifest:
        """A version whose bytes travel another way (object store, collective, disk)."""
        validate_manifest(manifest)
        if GRPC_TRANSPORT in manifest.transports:
            raise InvalidArgument("manifest.transports", "a grpc version must carry its bytes (send the chunks)")
        if not manifest.transports:
            raise InvalidArgument("manifest.transports", "name the transport that carries the bytes")
        return self._commit(manifest, None, now, payload)

    def _commit(self, manifest: Manifest, buffers: list[torch.Tensor] | None, now: float,
                payload: object | None = None) -> Manifest:
        v = manifest.policy_version
        existing = self._versions.get(v)
        if existing is not None and existing.manifest.checksum != manifest.checksum and self._orphan(existing):
            # A trainer publishes only the version after the coordinator's committed one, so a
            # version that differs and that no consumer has seen is the orphan of a trainer that
            # died (or lost its reply) between publish and commit: its successor, resumed from a
            # checkpoint, publishes the same number with other weights. Nobody can observe the swap.
            log.warning("param_server_orphan_version_replaced", policy_version=v,
                        old_checksum=existing.manifest.checksum[:12], new_checksum=manifest.checksum[:12])
            for b in existing.buffers or ():
                self.pool.give(b)
            existing.buffers = None
            del self._versions[v]
            # What the orphan held through a transport its successor does not use (a `disk`
            # directory a grpc publish leaves in place) goes now, as an eviction's would: no later
            # eviction of this number names that transport again.
            gone = tuple(sorted(set(existing.manifest.transports) - set(manifest.transports)))
            if gone and self._on_evict is not None:
                self._on_evict(replace(existing, manifest=replace(existing.manifest, transports=gone)))
            existing = None
        if existing is not None:
            if existing.manifest.checksum != manifest.checksum:
                for b in buffers or ():
                    self.pool.give(b)
                raise immutable_refusal(v, existing.manifest.checksum, manifest.checksum, existing.seen_by)
            # Same content over another transport: merge what the two carry.
            existing.manifest = existing.manifest.with_transports(manifest.transports)
            if existing.buffers is None and buffers is not None:
                existing.buffers = buffers
            elif buffers is not None:
                for b in buffers:
                    self.pool.give(b)
            if payload is not None:
                existing.payload = payload
            return existing.manifest
        stored = StoredVersion(
            manifest=replace(manifest, created_unix_s=manifest.created_unix_s or now), buffers=buffers, payload=payload
        )
        self._versions[v] = stored
        self.sweep(now)
        return stored.manifest

    def _seen(self, stored: StoredVersion, who: str) -> None:
        if len(stored.seen_by) < SEEN_BY_KEPT and who not in stored.seen_by:
            stored.seen_by.append(who)
        if not stored.served:
            stored.served = True
            if self.on_served is not None:
                self.on_served(stored)

    @staticmethod
    def _orphan(stored: StoredVersion) -> bool:
        return not stored.served and not stored.holds and not stored.readers

    # ---- reads ----------------------------------------------------------------------------------

    def _resolve(self, policy_version: int) -> StoredVersion:
        if policy_version < 0:
            if not self._versions:
                raise NotFound("no version has been published yet")
            return self._versions[max(self._versions)]
        try:
            return self._versions[policy_version]
        except KeyError:
            if policy_version in self._uploads:
                raise NotFound(f"version {policy_version} is still being published (not yet complete)") from None
            have = sorted(self._versions)
            raise NotFound(
                f"version {policy_version} is not held (held: {have}); it was never published or was evicted "
                "(raise param_server.retain_versions, or AcquireVersion to pin versions you still need)"
            ) from None

    def get(self, policy_version: int) -> StoredVersion:
        return self._resolve(policy_version)

    def manifest(self, policy_version: int) -> Manifest:
        """A version's manifest (GetManifest). It does not mark the version seen, by number or as
        the newest: a manifest hands out no weights, and the uncommitted orphan of a dead trainer
        shows up in ListVersions, so a dashboard, grpcurl or the weights bench reading it made it
        immutable and the resumed trainer's republish of its number (the only one CommitVersion
        takes) failed on every restart. The answer names the checksum, which a later fetch checks
        (check_against_manifest); loading the bytes (AcquireVersion, FetchWeights) marks it seen."""
        return self._resolve(policy_version).manifest

    def newest_version(self) -> int | None:
        return max(self._versions) if self._versions else None

    def versions(self) -> list[StoredVersion]:
        return [self._versions[v] for v in sorted(self._versions)]

    @contextmanager
    def reading(self, policy_version: int) -> Iterator[StoredVersion]:
        """Pin a version while its bytes are being sent."""
        stored = self._resolve(policy_version)
        if stored.buffers is None:
            raise FailedPrecondition(
                f"version {stored.policy_version} travels over {list(stored.manifest.transports)}; the param "
                "server does not hold its bytes (fetch it over that transport, or publish it over grpc too)"
            )
        self._seen(stored, "a FetchWeights stream")
        stored.readers += 1
        try:
            yield stored
        finally:
            stored.readers -= 1

    # ---- holds and retention --------------------------------------------------------------------

    def acquire(self, consumer_id: str, policy_version: int, now: float) -> Manifest:
        if not consumer_id:
            raise InvalidArgument("consumer_id", "required (a stable id of the consumer, e.g. its replica id)")
        stored = self._resolve(policy_version)
        # a hold that expired (not swept yet) counts as a new holder: else returning consumers overrun the quota
        if stored.holds.get(consumer_id, 0.0) <= now and stored.live_holders(now) >= self.settings.max_holders_per_version:
            raise ResourceExhausted(
                f"version {stored.policy_version} already has {self.settings.max_holders_per_version} holders "
                "(param_server.max_holders_per_version); release holds you no longer need"
            )
        stored.holds[consumer_id] = now + self.settings.hold_ttl_s
        self._seen(stored, f"AcquireVersion({'newest' if policy_version < 0 else policy_version}) "
                           f"by {consumer_id!r}")
        return stored.manifest

    def release(self, consumer_id: str, policy_version: int, now: float) -> None:
        stored = self._versions.get(policy_version)
        if stored is not None:
            stored.holds.pop(consumer_id, None)
        self.sweep(now)

    def sweep(self, now: float) -> list[StoredVersion]:
        """Drop expired holds and evict what retention no longer keeps. Returns the evicted."""
        newest = sorted(self._versions, reverse=True)
        keep = set(newest[: self.settings.retain_versions])
        evicted = []
        for v in newest:
            stored = self._versions[v]
            stored.holds = {c: e for c, e in stored.holds.items() if e > now}
            if v in keep or stored.holds or stored.readers:
                continue
            del self._versions[v]
            evicted.append(stored)
        for stored in evicted:
            self.evicted_total += 1
            for buf in stored.buffers or ():
                self.pool.give(buf)
            stored.buffers = None
            if self._on_evict is not None:
                self._on_evict(stored)
        return evicted

    def stalled_uploads(self, now: float) -> list[Upload]:
        return [u for u in self._uploads.values() if now - u.last_activity >= self.settings.stall_timeout_s]

    @property
    def bytes_held(self) -> int:
        return sum(sum(b.numel() for b in s.buffers or ()) for s in self._versions.values())
