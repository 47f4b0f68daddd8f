"""The `object_store` transport: Ray object refs, for consumers in the same Ray cluster.

    trainer: one ray.put per bucket: its bytes as a list of arrays (one for a packed bucket,
             as the FSDP export hands over: `pack_stream`; else one per tensor), which Ray writes as
             out-of-band buffers of one object (one copy into shared memory, one create/seal
             round trip with the raylet per bucket instead of per tensor; the bucket's
             fingerprint is its packer's (packing.py: taken as the export copied each tensor in,
             on the device for a GPU trainer), else computed alongside, in other threads; on a
             host with >= 8 CPUs two buckets are put at once, the next bucket exported while they
             copy; a bucket that crossed from a trainer rank on this node is already such an
             object, owned here: it is registered as it is, no put) ─▶ the param
             server's object_refs actor keeps the manifest + refs (a plain actor call; refs stay
             refs; the replica's store gets the manifest behind it)
    rollout: the object_refs actor (a plain call, no hold: the fetch's borrowed refs keep the
             objects) ─▶ manifest + refs ─▶ ray.get: on the same node the
             arrays map the publisher's shared memory (zero copy); from another node Ray pulls them
             ─▶ the manifest checked (the ref's checksum, its content against that checksum)
             ─▶ each bucket checked against it (sizes always, fingerprint per object_store_verify:
             `remote` fingerprints every bucket not put on this node, read from the ref's owner)
             ─▶ after the last bucket, the directory's release, awaited beside the caller (a
             no-op for ServeDirectory, which takes no hold; a directory that pins versions gets
             its releases in order: this fetcher's next fetch or close waits for them; a failed
             one is logged and counted)

The object_refs actor keeps the refs (as a borrower) until retention drops the version, so the
objects live exactly as long as the version is retained, or a fetch that looked it up still reads
it; then the publisher (their owner) frees
them and the raylet deletes them in its next batch of frees (`free_objects_period_milliseconds`,
which `init_ray` sets to 10 ms for a local Ray; Ray's default is 1 s), after which the store reuses
their pages (a put into fresh shared memory pays a page fault per page). The objects are owned by the process
that put them: if the trainer process dies, its versions in the object store are gone (fetch
raises Unavailable; the next version it publishes after restarting is fine).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import os
import warnings
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
import torch

from meshrl.v1 import common_pb2
from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import DataLoss, InvalidArgument, MissingDependency, Unavailable
from services.common.logging import get_logger

from .. import convert
from ..layout import Fingerprinter, Manifest, validate_manifest
from ..packing import WireBucket, storage_runs, wire_arrays
from ..protocols import Bucket, Buckets
from .base import Deadline, ManifestBuilder, PlannedBucket, check_against_manifest, plan_buckets

log = get_logger(__name__)
TRANSPORT = "object_store"
T = TypeVar("T")


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise MissingDependency("ray", "the object_store transport needs Ray: pip install 'ray[serve]'") from exc
    if not ray.is_initialized():
        raise Unavailable("the object_store transport runs inside a Ray cluster (ray.init() first), or use grpc")
    return ray


class ObjectDirectory(Protocol):
    """Where versions' object refs are registered: the param server deployment (ServeDirectory)."""

    async def register(self, manifest: pb.Manifest, refs: list[Any]) -> None: ...

    async def lookup(self, policy_version: int, consumer_id: str) -> tuple[pb.Manifest, list[Any]]: ...

    def release(self, policy_version: int, consumer_id: str) -> Awaitable[None]:
        """Drop `consumer_id`'s hold. Sent when called (the awaitable is its outcome), where the
        directory can: a fetcher's loop that ends before awaiting it must not leak the hold."""
        ...


BOARD_TIMEOUT_S = 60.0
"""How long a manifest's post to the param server replica's board may take before it counts as
failed (the board serves ListVersions / GetManifest; fetches do not need it)."""


class ServeDirectory:
    """ObjectDirectory of the param server's Serve app: its versions' refs are kept by a plain Ray
    actor the replica hands out (services/param_server/object_refs.py), so registrations and
    lookups are plain actor calls, not Serve handle calls through its router. The replica's store
    gets each manifest behind the registration (its board: ListVersions, GetManifest, metrics)."""

    def __init__(self, handle: Any, *, board_timeout_s: float = BOARD_TIMEOUT_S) -> None:
        self.handle = handle
        self.board_timeout_s = board_timeout_s
        self._refs: Any = None  # the object_refs actor, asked of the replica once
        self._board: asyncio.Task[None] | None = None  # the last manifest on its way to the replica's store
        self.board_failures = 0

    @classmethod
    def from_app(cls, app_name: str = "param_server", deployment: str = "ParamServer") -> ServeDirectory:
        from ray import serve

        return cls(serve.get_deployment_handle(deployment, app_name=app_name))

    async def connect(self) -> None:
        """Get the object_refs actor and wait until it answers (else the first call does)."""
        await self._call("stats")

    async def _table(self, stale: Any = None) -> Any:
        if self._refs is None or self._refs is stale:
            self._refs = await self.handle.object_refs.remote()
        return self._refs

    async def _call(self, method: str, *args: Any) -> Any:
        """A call on the object_refs actor; asked for again once if it died (the replica makes a
        new one: the versions it held are gone, a registration goes into the new one)."""
        ray = _ray()
        table = await self._table()
        try:
            return await getattr(table, method).remote(*args)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            log.warning("object_refs_unreachable", method=method, error=f"{type(exc).__name__}: {exc}")
            table = await self._table(stale=table)
            return await getattr(table, method).remote(*args)

    async def _post_board(self, raw: bytes, version: int) -> None:
        try:
            # bounded: a replica that never answers would hold the next registration (it waits
            # for this one) and the publisher's close
            await asyncio.wait_for(self.handle.register_object_store_version.remote(raw), timeout=self.board_timeout_s)
        except Exception as exc:  # noqa: BLE001 -- the board only: fetchers have the version already
            self.board_failures += 1
            log.warning("board_registration_failed", policy_version=version, error=f"{type(exc).__name__}: {exc}",
                        hint="ListVersions/GetManifest miss this version; fetches are not affected")

    async def settle(self) -> None:
        """Wait for the last manifest to reach the replica's store (its failure is logged)."""
        board, self._board = self._board, None
        if board is not None:
            await board

    async def register(self, manifest: pb.Manifest, refs: list[Any]) -> None:
        await self.settle()  # manifests reach the board in version order
        raw = manifest.SerializeToString()
        await self._call("register", raw, refs)
        self._board = asyncio.ensure_future(self._post_board(raw, manifest.policy_version))

    async def lookup(self, policy_version: int, consumer_id: str) -> tuple[pb.Manifest, list[Any]]:
        raw, refs = await self._call("lookup", policy_version)
        return pb.Manifest.FromString(raw), list(refs)

    def release(self, policy_version: int, consumer_id: str) -> Awaitable[None]:
        # a lookup takes no hold: the fetch's borrowed refs keep its objects (object_refs.py)
        return _known(None)


def _layout_arrays(planned: PlannedBucket) -> list[tuple[int, np.ndarray]]:
    """(offset, host bytes) runs tiling a bucket, in layout order: one per run of tensors lying
    back to back in one storage (a packed bucket, `pack_bucket`: one run), else one per tensor."""
    pairs = sorted(((meta, t) for meta, (_, t) in zip(planned.metas, planned.named, strict=True)),
                   key=lambda x: x[0].offset)
    return [(offset, run.cpu().numpy()) for offset, run in storage_runs(pairs)]


def _views_only(planned: PlannedBucket) -> bool:
    """Whether `_layout_arrays` only makes views (host tensors, contiguous): then it runs inline,
    a thread hop costing more than the work; a device copy or a gather runs in a thread."""
    return all(t.device.type == "cpu" and t.is_contiguous() for _, t in planned.named)


def _put_bucket(ray: Any, arrays: list[tuple[int, np.ndarray]]) -> list[Any]:
    """One object per bucket (a list of the arrays tiling it, layout order): ray.put pickles the
    list with the arrays as out-of-band buffers, so the bytes are copied once, straight into the
    object (a packed bucket is one array: Ray copies one large buffer faster than several)."""
    return [ray.put([a for _, a in arrays])]


def _bucket_arrays(got: list[Any]) -> Any:
    """A bucket's arrays from what ray.get returned for its refs: one object holding the list
    (this publisher's put), one WireBucket (a rank's export registered as it crossed), or one
    array per ref (publishers before one-put-per-bucket)."""
    if len(got) == 1 and isinstance(got[0], list):
        return got[0]
    if len(got) == 1 and isinstance(got[0], WireBucket):
        return wire_arrays(got[0])
    return got


def _cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# Threads a bucket's fingerprint is split over: it runs beside the put, whose copy is parallel,
# and a single-threaded pass would outlast it.
FINGERPRINT_THREADS = max(1, min(4, _cpus()))
# Buckets being put at once. Ray copies one object with a fixed 6 threads, which leaves a many-core
# host's memory bandwidth idle; a second bucket in flight (its own put and fingerprint) uses it. On
# a few cores the two would only take turns. Each one in flight holds its bucket's host memory.
PUTS_IN_FLIGHT = 2 if _cpus() >= 8 else 1


def _split(arrays: list[tuple[int, np.ndarray]], parts: int) -> list[list[tuple[int, np.ndarray]]]:
    """(offset, array) pieces of a bucket in `parts` runs of about equal bytes (views, no copy)."""
    total = max((offset + a.nbytes for offset, a in arrays), default=0)  # the bucket's end, gaps or not
    step = max(8, -(-total // max(1, parts) // 8) * 8)  # whole words: no piece splits one
    runs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(-(-total // step) if total else 1)]
    for offset, arr in arrays:
        flat = arr.reshape(-1)
        pos = 0
        while pos < flat.nbytes:
            run = (offset + pos) // step
            end = min(flat.nbytes, (run + 1) * step - offset)
            runs[run].append((offset + pos, flat[pos:end]))
            pos = end
    return runs


def _fingerprint_part(nbytes: int, arrays: list[tuple[int, np.ndarray]]) -> Fingerprinter:
    fp = Fingerprinter(nbytes)
    for offset, arr in arrays:
        fp.update(offset, arr)
    return fp


async def _fingerprint(nbytes: int, arrays: list[tuple[int, np.ndarray]], threads: int = FINGERPRINT_THREADS) -> str:
    """The bucket's fingerprint, its pieces summed in `threads` threads (numpy releases the GIL)."""
    parts = await asyncio.gather(*(asyncio.to_thread(_fingerprint_part, nbytes, run)
                                   for run in _split(arrays, threads)))
    fp = parts[0]
    for other in parts[1:]:
        fp.merge(other)
    return fp.hexdigest()


async def _known(value: T) -> T:
    return value


class ObjectStorePublisher:
    """Puts buckets into the Ray object store and registers them with the param server."""

    transport = TRANSPORT

    def __init__(self, directory: ObjectDirectory, *, address: str = "", timeout_s: float = 300.0,
                 puts_in_flight: int | None = None) -> None:
        puts_in_flight = PUTS_IN_FLIGHT if puts_in_flight is None else puts_in_flight
        if puts_in_flight < 1:
            raise InvalidArgument("puts_in_flight", f"{puts_in_flight}: at least one bucket must be put at a time")
        self.directory = directory
        self.address = address
        self.timeout_s = timeout_s
        self.puts_in_flight = puts_in_flight

    async def close(self) -> None:
        """Wait for what the last registration left on its way (ServeDirectory: the manifest to
        the replica's store)."""
        settle = getattr(self.directory, "settle", None)
        if settle is not None:
            await settle()

    async def publish(self, version: int, buckets: Buckets) -> common_pb2.WeightsRef:
        ray = _ray()
        deadline = Deadline(self.timeout_s, f"publish of version {version} to the object store")
        builder = ManifestBuilder(version)
        refs: list[list[Any]] = []
        # buckets being put, oldest first: (bucket, its put, its fingerprint); finished in order
        pending: deque[tuple[PlannedBucket, asyncio.Future[list[Any]], asyncio.Future[str]]] = deque()

        async def finish_oldest() -> None:
            planned, put, fingerprint = pending[0]
            refs.append(await asyncio.wait_for(put, timeout=deadline.check(f"putting bucket {planned.index}")))
            builder.add(planned, await fingerprint)
            pending.popleft()

        try:
            async for planned in plan_buckets(buckets):
                packed = planned.packed
                if packed is not None and packed.stored is not None:
                    # already an object in this node's store, owned here (a rank's export as it
                    # crossed to this process, packing.from_wire): registered as it is, no put
                    putting: Awaitable[list[Any]] = _known([packed.stored])
                    fingerprint: Awaitable[str] = _known(packed.fingerprint)
                else:
                    arrays = (_layout_arrays(planned) if _views_only(planned)
                              else await asyncio.to_thread(_layout_arrays, planned))
                    putting = asyncio.to_thread(_put_bucket, ray, arrays)
                    fingerprint = _known(packed.fingerprint) if packed is not None else _fingerprint(planned.nbytes, arrays)
                pending.append((planned, asyncio.ensure_future(putting), asyncio.ensure_future(fingerprint)))
                while len(pending) >= self.puts_in_flight:
                    await finish_oldest()
            while pending:
                await finish_oldest()
        finally:
            # a failed publish: its other buckets are abandoned (a put's thread runs to its end;
            # nothing references what it made, so the store frees it)
            for _, put, fingerprint in pending:
                for f in (put, fingerprint):
                    if not f.cancel() and not f.cancelled():
                        f.exception()  # done: its error (if any) is this failure's, already raised or moot
        manifest = builder.build([TRANSPORT])
        await asyncio.wait_for(self.directory.register(convert.manifest_to_proto(manifest), refs),
                               timeout=deadline.check("registering the version"))
        log.info("weights_published", transport=TRANSPORT, policy_version=version, total_bytes=manifest.total_bytes,
                 buckets=len(refs))
        return convert.weights_ref(manifest, self.address)


def _put_here(ray: Any, refs: list[Any]) -> list[bool]:
    """Whether each ref's object was put on this node: its owner (the process that put it) runs
    here, and a put writes the object into its own node's store, so these bytes are the
    publisher's own, never transferred (a trainer rank's export registered as it crossed is owned
    by the trainer's replica and counts only when that rank runs on the replica's node:
    RayTrainGroup). Anything else was pulled from another node (a copy another
    consumer here pulled earlier too: each reader verifies it). Read from the refs themselves, no
    round trip; unknown means verify."""
    try:
        from ray.core.generated.common_pb2 import Address  # type: ignore[attr-defined]  # generated, unstubbed

        here = bytes.fromhex(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 -- locality only spares a check; unknown means verify
        return [False] * len(refs)

    def put_here(ref: Any) -> bool:
        try:
            return bool(Address.FromString(ref.owner_address()).node_id == here)
        except Exception:  # noqa: BLE001
            return False

    return [put_here(ref) for ref in refs]


def _check_arrays(manifest: Manifest, index: int, arrays: Any, verify: bool) -> Bucket:
    """The bucket's tensors, as views of the arrays that tile its bytes in layout order (one per
    run of the publisher's storage: a packed bucket is one array, an unpacked one an array per
    tensor); sizes always checked, the fingerprint when `verify`."""
    metas = sorted(manifest.bucket_tensors(index), key=lambda m: m.offset)
    meta = manifest.buckets[index]
    if not isinstance(arrays, list) or not all(isinstance(a, np.ndarray) and a.dtype == np.uint8 and a.ndim == 1
                                               for a in arrays):
        raise DataLoss(f"bucket {index}: the object is not a list of byte arrays")
    starts = list(itertools.accumulate((a.nbytes for a in arrays), initial=0))
    if starts[-1] != meta.nbytes:
        raise DataLoss(f"bucket {index} holds {starts[-1]} bytes, the manifest {meta.nbytes}")
    fp = Fingerprinter(meta.nbytes) if verify else None
    if fp is not None:
        for start, arr in zip(starts[:-1], arrays, strict=True):
            fp.update(start, arr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only shared memory: consumers copy
        tensors = [torch.from_numpy(a) for a in arrays]
    out = []
    for m in metas:
        i = bisect.bisect_right(starts, m.offset) - 1
        if m.nbytes and (i >= len(arrays) or m.offset + m.nbytes > starts[i + 1]):
            raise DataLoss(f"bucket {index}: {m.name} (bytes {m.offset}..{m.offset + m.nbytes}) is not inside one "
                           "of the object's arrays")
        raw = tensors[i][m.offset - starts[i] : m.offset - starts[i] + m.nbytes] if m.nbytes else torch.empty(0, dtype=torch.uint8)
        out.append((m.name, raw.view(m.dtype).view(m.shape)))
    if fp is not None and fp.hexdigest() != meta.fingerprint:
        raise DataLoss(f"bucket {index}: fingerprint {fp.hexdigest()} != manifest {meta.fingerprint}")
    order = {m.name: i for i, m in enumerate(manifest.bucket_tensors(index))}
    out.sort(key=lambda x: order[x[0]])
    return out


class ObjectStoreFetcher:
    """Gets versions from the object store through the param server's directory of refs."""

    transport = TRANSPORT

    def __init__(
        self,
        directory: ObjectDirectory,
        *,
        consumer_id: str,
        verify: Literal["always", "remote"] = "remote",
        timeout_s: float = 300.0,
        max_attempts: int = 3,
    ) -> None:
        if not consumer_id:
            raise InvalidArgument("consumer_id", "required (a stable id of this consumer)")
        self.directory = directory
        self.consumer_id = consumer_id
        self.verify = verify
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.verified_buckets = 0
        self.release_failures = 0
        # holds being released: a fetch's release runs after its last bucket, beside the caller
        # (one handle call the consumer need not wait for); strong refs keep the tasks alive
        self._releases: set[asyncio.Task[None]] = set()

    async def _release(self, version: int, sent: Awaitable[None]) -> None:
        try:
            await asyncio.wait_for(sent, timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 -- the hold expires after param_server.hold_ttl_s
            self.release_failures += 1
            log.warning("release_failed", policy_version=version, consumer_id=self.consumer_id,
                        error=f"{type(exc).__name__}: {exc}")

    def _release_soon(self, version: int) -> None:
        sent: Awaitable[None] | None = None
        try:
            sent = self.directory.release(version, self.consumer_id)  # on its way now (ServeDirectory)
            task = asyncio.get_running_loop().create_task(self._release(version, sent))
        except Exception as exc:  # noqa: BLE001 -- e.g. no loop (a generator finalized outside one)
            if asyncio.iscoroutine(sent):
                sent.close()
            self.release_failures += 1
            log.warning("release_failed", policy_version=version, consumer_id=self.consumer_id,
                        error=f"{type(exc).__name__}: {exc}")
            return
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def settle(self) -> None:
        """Wait for the releases of earlier fetches to reach the param server."""
        while pending := [t for t in self._releases if not t.done()]:
            await asyncio.gather(*pending, return_exceptions=True)

    async def close(self) -> None:
        await self.settle()

    async def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Bucket]:
        ray = _ray()
        version = ref.policy_version
        deadline = Deadline(self.timeout_s, f"fetch of version {version} from the object store")
        # this consumer's earlier releases land first (done long since when fetches are a
        # training step apart): holds are released in order and never pile up
        await asyncio.wait_for(self.settle(), timeout=deadline.check("releasing earlier versions"))
        try:
            raw, refs = await asyncio.wait_for(self.directory.lookup(version, self.consumer_id),
                                               timeout=deadline.check("looking up the version"))
        except BaseException:
            if version >= 0:  # the hold may have been taken before the reply was lost: it goes (a no-op if not)
                self._release_soon(version)
            raise
        version = raw.policy_version  # a negative ref version asked for the newest: the one pinned
        try:
            manifest = convert.manifest_from_proto(raw)
            check_against_manifest(manifest, ref, "object_store fetch")
            try:  # the fingerprints cover the bytes; the checksum covers where each tensor lies in them
                validate_manifest(manifest)
            except InvalidArgument as exc:
                raise DataLoss(f"object_store fetch of version {version}: the manifest the directory answered "
                               f"does not check out ({exc})") from None
            if len(refs) != len(manifest.buckets):
                raise DataLoss(f"version {version}: {len(refs)} objects for {len(manifest.buckets)} buckets")
            firsts = [orefs[0] for orefs in refs if orefs]
            local = dict(zip(firsts, _put_here(ray, firsts), strict=True)) if self.verify != "always" and firsts else {}
            for i, orefs in enumerate(refs):
                verify = self.verify == "always" or not orefs or not local.get(orefs[0], False)
                for attempt in range(1, self.max_attempts + 1):
                    try:
                        arrays = await asyncio.to_thread(ray.get, list(orefs), timeout=deadline.check(f"getting bucket {i}"))
                    except ray.exceptions.GetTimeoutError:
                        raise deadline.stalled(f"getting bucket {i}", self.timeout_s) from None
                    except ray.exceptions.ObjectLostError as exc:  # OwnerDiedError, ObjectFetchTimedOutError too
                        raise Unavailable(
                            f"version {version} bucket {i} is gone from the object store ({type(exc).__name__}); "
                            "its owner (the publishing trainer) may have exited: fetch a newer version"
                        ) from exc
                    try:
                        # unverified, the check reads no bytes (sizes and views): inline
                        bucket = (await asyncio.to_thread(_check_arrays, manifest, i, _bucket_arrays(arrays), True)
                                  if verify else _check_arrays(manifest, i, _bucket_arrays(arrays), False))
                        break
                    except DataLoss:
                        if attempt == self.max_attempts:
                            raise
                        log.warning("bucket_corrupt_refetching", policy_version=version, bucket=i, attempt=attempt)
                        del arrays
                if verify:
                    self.verified_buckets += 1
                yield bucket
                del bucket, arrays
        finally:
            self._release_soon(version)
