"""ParamServerService over gRPC: proto in -> store call -> proto out (or a status code).

The same servicer runs as a plain grpc.aio server (server.py, with the zero-copy chunk codec of
services/weights/wire.py: chunks arrive as `RawChunk`, leave through FetchWeightsRaw) and under Ray Serve
(deployment.py, where every message is a proto); both can serve one store at once. Store calls happen on one asyncio loop; only the per-chunk copy and
fingerprint run in a worker thread. Waiting RPCs (Rendezvous) sleep on `_changed`, an event
replaced after every change.

Deadlines. An upload that goes silent for `stall_timeout_s` fails with DEADLINE_EXCEEDED and its
partial version is dropped; the whole upload is bounded by `transfer_timeout_s`. A fetch is bounded
by the client's deadline (gRPC cancels the stream server-side when it passes) and by
`transfer_timeout_s`; on a plain server a reader that stops reading is cut after
`security.limits.stream_stall_timeout_s` (services/common/interceptor.py). Either way the stream's
pin on its version is released.

Quotas. At most `max_concurrent_uploads` PublishWeights streams at once (more are answered
UNAVAILABLE: a slot frees within `stall_timeout_s`, and publishers retry); an upload may not
announce or allocate more than the store's `max_upload_bytes`. Only the trainer role may check in
to a rendezvous as the sender, or probe it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from meshrl.v1 import param_server_pb2, param_server_pb2_grpc
from services.common.auth import TRAINER, Authorizer
from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.common.grpc_util import rpc_method
from services.common.interceptor import require_role
from services.common.logging import get_logger
from services.weights import convert
from services.weights.layout import host_view
from services.weights.wire import RawChunk

from .convert import version_info
from .rendezvous import RendezvousBoard
from .store import Upload, WeightStore

log = get_logger(__name__)

MiB = 1 << 20
_CHUNK_OVERHEAD = 64 * 1024


@dataclass
class TransferCounters:
    """Cumulative numbers of the bytes that pass through this server (the grpc transport; the
    others move bytes elsewhere), for its metrics (services/param_server/metrics.py)."""

    bytes_in: int = 0
    bytes_out: int = 0
    publishes: int = 0
    publish_s: float = 0.0
    last_publish_s: float = 0.0
    fetches: int = 0
    fetch_s: float = 0.0
    last_fetch_s: float = 0.0


class ParamServerServicer(param_server_pb2_grpc.ParamServerServiceServicer):
    """Thin shim over WeightStore and RendezvousBoard."""

    def __init__(
        self,
        store: WeightStore,
        *,
        address: str = "",
        chunk_bytes: int = 4 * MiB,
        max_message_bytes: int = 64 * MiB,
        transfer_timeout_s: float = 300.0,
        stall_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        io_threads: int = 2,
        max_concurrent_uploads: int = 4,
        auth: Authorizer | None = None,
    ) -> None:
        self.store = store
        self.address = address
        self.chunk_bytes = chunk_bytes
        self.max_chunk_bytes = max_message_bytes - _CHUNK_OVERHEAD
        self.transfer_timeout_s = transfer_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.max_concurrent_uploads = max_concurrent_uploads
        self.uploads_in_flight = 0
        self.auth = auth
        # Generations numbered from the wall clock (µs): a restarted param server never answers a
        # generation its members still hold from before (they would keep their old process group
        # under ranks the new board handed out anew, and rebuild on the old store prefix).
        self.board = RendezvousBoard(replace_after_s=stall_timeout_s, first_generation=time.time_ns() // 1000)
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="ps-io")
        self._changed = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self.counters = TransferCounters()

    # ---- housekeeping -----------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def start_sweeper(self, interval_s: float = 5.0) -> None:
        """Expire holds, evict, and drop stalled uploads on a timer."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(interval_s))

    async def _sweep(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            now = self.clock()
            for upload in self.store.stalled_uploads(now):
                log.warning("upload_stalled_dropped", policy_version=upload.policy_version)
                upload.abort()
            self.store.sweep(now)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._io.shutdown(wait=False, cancel_futures=True)

    # ---- publish ----------------------------------------------------------------------------------

    @rpc_method()
    async def PublishWeights(self, request_iterator: Any, context: Any) -> param_server_pb2.PublishWeightsResponse:
        if self.uploads_in_flight >= self.max_concurrent_uploads:
            # UNAVAILABLE, as for a version's upload slot (WeightStore.begin_upload): a slot frees
            # when a stream ends, at the latest stall_timeout_s after it stops sending (a publisher
            # that died or gave the attempt up), so the trainer's publish retries it with backoff
            # (TrainerLoop._republish, bounded by trainer_service.coordinator_wait_s). It was
            # RESOURCE_EXHAUSTED, which the trainer does not retry: its loop failed outright while
            # attempts it had given up on still held the slots.
            raise Unavailable(
                f"{self.uploads_in_flight} uploads are in progress (param_server.max_concurrent_uploads="
                f"{self.max_concurrent_uploads}); a slot frees when one ends, at the latest "
                f"param_server.stall_timeout_s={self.stall_timeout_s:g}s after it stops sending; retry then"
            )
        self.uploads_in_flight += 1
        try:
            return await self._publish(request_iterator)
        finally:
            self.uploads_in_flight -= 1

    async def _publish(self, request_iterator: Any) -> param_server_pb2.PublishWeightsResponse:
        start = time.monotonic()
        deadline = start + self.transfer_timeout_s
        loop = asyncio.get_running_loop()
        upload: Upload | None = None
        early_buckets: list[param_server_pb2.BucketMeta] = []
        manifest_only = None
        writing: concurrent.futures.Future[None] | None = None  # the chunk write in the io pool
        it = request_iterator.__aiter__()
        try:
            while True:
                wait_s = min(self.stall_timeout_s, deadline - time.monotonic())
                try:
                    req = await asyncio.wait_for(it.__anext__(), timeout=max(wait_s, 0.0))
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    what = f"version {upload.policy_version}" if upload else "a version"
                    raise DeadlineExceeded(
                        f"publish of {what}: no data for {wait_s:.1f}s (the publisher stopped sending or the "
                        f"{self.transfer_timeout_s:.0f}s transfer deadline passed); the partial version was dropped"
                    ) from None
                now = self.clock()
                item: Any
                if isinstance(req, RawChunk):
                    kind, item = "chunk", req
                else:
                    kind = req.WhichOneof("item")
                    item = RawChunk.from_proto(req.chunk) if kind == "chunk" else getattr(req, kind or "manifest")
                if kind == "manifest":
                    m = convert.manifest_from_proto(item)
                    if manifest_only is not None:  # as a grpc upload refuses its second manifest
                        raise InvalidArgument("manifest", "sent twice in one stream; send one version per stream")
                    if upload is None and not early_buckets and m.transports and "grpc" not in m.transports:
                        manifest_only = m
                        continue
                    if upload is None:
                        upload = self._begin(m.policy_version, early_buckets, now)
                    upload.set_manifest(m)
                elif kind == "bucket":
                    if upload is None:
                        self._hold_early(early_buckets, item, manifest_only)
                    else:
                        upload.begin_bucket(convert.bucket_from_proto(item))
                elif kind == "chunk":
                    if manifest_only is not None:
                        raise InvalidArgument("chunk", "bytes sent for a version registered as "
                                              f"{list(manifest_only.transports)} only; add grpc to manifest.transports")
                    if upload is None:
                        upload = self._begin(item.policy_version, early_buckets, now)
                    elif item.policy_version != upload.policy_version:
                        raise InvalidArgument("chunk.policy_version", f"{item.policy_version} in an upload of "
                                              f"version {upload.policy_version}")
                    bucket = upload.check_chunk(item.bucket_index, item.offset, len(item.data))
                    writing = self._io.submit(Upload.write, bucket, item.offset, item.data)
                    await asyncio.wrap_future(writing)
                    self.counters.bytes_in += len(item.data)
                else:
                    raise InvalidArgument("item", "empty PublishWeightsRequest")
                if upload is not None:
                    upload.touch(now)
            if manifest_only is not None:
                manifest = self.store.register(manifest_only, self.clock())
            elif upload is None:
                raise InvalidArgument("manifest", "the stream carried nothing")
            else:
                manifest = upload.finish(self.clock())
                upload = None
        finally:
            if upload is not None and not upload.done:
                if writing is not None and not writing.done():
                    # cancelled mid-write: the thread still writes into the upload's buffers, which
                    # go back to the pool (and to another upload) only once it has finished
                    writing.add_done_callback(_abort_when_written(loop, upload))
                else:
                    upload.abort()
        elapsed = time.monotonic() - start
        self.counters.publishes += 1
        self.counters.publish_s += elapsed
        self.counters.last_publish_s = elapsed
        log.info("version_published", policy_version=manifest.policy_version, total_bytes=manifest.total_bytes,
                 transports=list(manifest.transports), publish_s=round(elapsed, 3))
        self._notify()
        return param_server_pb2.PublishWeightsResponse(
            policy_version=manifest.policy_version, total_bytes=manifest.total_bytes, publish_s=elapsed
        )

    def _hold_early(self, early: list[param_server_pb2.BucketMeta], meta: param_server_pb2.BucketMeta,
                    manifest_only: Any) -> None:
        """A BucketMeta before the upload opens (no manifest, no chunk yet): held, checked as it
        comes (order, the upload quota) so a stream of them alone is refused at once, not held."""
        if manifest_only is not None:
            raise InvalidArgument("bucket", "bucket metadata for a version registered as "
                                  f"{list(manifest_only.transports)} only; add grpc to manifest.transports")
        if meta.index != len(early):
            raise InvalidArgument("bucket.index", f"expected bucket {len(early)}, got {meta.index}; send buckets in order")
        self.store._check_size(sum(b.nbytes for b in early) + meta.nbytes, f"bucket[{meta.index}].nbytes")
        early.append(meta)

    def _begin(self, policy_version: int, early: list[param_server_pb2.BucketMeta], now: float) -> Upload:
        upload = self.store.begin_upload(policy_version, now)
        try:
            for meta in early:
                upload.begin_bucket(convert.bucket_from_proto(meta))
        except BaseException:
            upload.abort()  # refused: no upload left registered, no buffer held
            raise
        early.clear()
        return upload

    # ---- fetch ------------------------------------------------------------------------------------

    async def fetch_items(self, request: param_server_pb2.FetchWeightsRequest) -> AsyncGenerator[Any, None]:
        """The manifest (as a FetchWeightsResponse) then RawChunks of the asked buckets."""
        start = time.monotonic()
        chunk = request.chunk_bytes or self.chunk_bytes
        deadline = time.monotonic() + self.transfer_timeout_s
        if not 0 < chunk <= self.max_chunk_bytes:
            raise InvalidArgument("chunk_bytes", f"must be in (0, {self.max_chunk_bytes}], got {chunk}")
        m = self.store.get(request.policy_version).manifest  # checked before the version is pinned and seen
        if request.bucket_indices:
            buckets = sorted(set(request.bucket_indices))
            bad = [i for i in buckets if i >= len(m.buckets)]
            if bad:
                raise InvalidArgument("bucket_indices", f"version {m.policy_version} has {len(m.buckets)} buckets")
        elif request.names:
            buckets = m.buckets_for_names(request.names)
        else:
            buckets = list(range(len(m.buckets)))
        with self.store.reading(m.policy_version) as stored:
            assert stored.buffers is not None
            yield param_server_pb2.FetchWeightsResponse(manifest=convert.manifest_to_proto(m))
            for i in buckets:
                view = host_view(stored.buffers[i])
                for off in range(0, len(view), chunk):
                    if time.monotonic() > deadline:
                        raise DeadlineExceeded(
                            f"fetch of version {m.policy_version} ran past param_server.transfer_timeout_s="
                            f"{self.transfer_timeout_s:g}s; the reader is too slow or stopped reading"
                        )
                    yield RawChunk(m.policy_version, i, off, view[off : off + chunk])
                    self.counters.bytes_out += min(chunk, len(view) - off)
        self.store.sweep(self.clock())
        elapsed = time.monotonic() - start
        self.counters.fetches += 1
        self.counters.fetch_s += elapsed
        self.counters.last_fetch_s = elapsed

    @rpc_method()
    async def FetchWeights(
        self, request: param_server_pb2.FetchWeightsRequest, context: Any
    ) -> AsyncIterator[param_server_pb2.FetchWeightsResponse]:
        """Standard protos (Serve's proxy, generated stubs)."""
        async with contextlib.aclosing(self.fetch_items(request)) as items:
            async for item in items:
                yield param_server_pb2.FetchWeightsResponse(chunk=item.to_proto()) if isinstance(item, RawChunk) else item

    @rpc_method(rpc="FetchWeights")
    async def FetchWeightsRaw(self, request: param_server_pb2.FetchWeightsRequest, context: Any) -> AsyncIterator[Any]:
        """The same stream with chunks as RawChunk, for the plain server's zero-copy codec."""
        async with contextlib.aclosing(self.fetch_items(request)) as items:  # the pin goes when the stream does
            async for item in items:
                yield item

    # ---- manifests, versions, holds ---------------------------------------------------------------

    @rpc_method()
    async def GetManifest(self, request: param_server_pb2.GetManifestRequest, context: Any) -> param_server_pb2.GetManifestResponse:
        return param_server_pb2.GetManifestResponse(
            manifest=convert.manifest_to_proto(self.store.manifest(request.policy_version))
        )

    @rpc_method()
    async def ListVersions(self, request: param_server_pb2.ListVersionsRequest, context: Any) -> param_server_pb2.ListVersionsResponse:
        now = self.clock()
        return param_server_pb2.ListVersionsResponse(
            versions=[version_info(s, now) for s in self.store.versions()]
        )

    @rpc_method()
    async def AcquireVersion(
        self, request: param_server_pb2.AcquireVersionRequest, context: Any
    ) -> param_server_pb2.AcquireVersionResponse:
        m = self.store.acquire(request.consumer_id, request.policy_version, self.clock())
        return param_server_pb2.AcquireVersionResponse(manifest=convert.manifest_to_proto(m))

    @rpc_method()
    async def ReleaseVersion(
        self, request: param_server_pb2.ReleaseVersionRequest, context: Any
    ) -> param_server_pb2.ReleaseVersionResponse:
        self.store.release(request.consumer_id, request.policy_version, self.clock())
        return param_server_pb2.ReleaseVersionResponse()

    # ---- rendezvous -------------------------------------------------------------------------------

    @rpc_method()
    async def Rendezvous(self, request: param_server_pb2.RendezvousRequest, context: Any) -> param_server_pb2.RendezvousResponse:
        remaining = getattr(context, "time_remaining", lambda: None)()
        budget = self.transfer_timeout_s if remaining is None else min(remaining, self.transfer_timeout_s)
        deadline = time.monotonic() + budget
        if request.role == "sender":
            require_role(context, TRAINER, "Rendezvous as the sender")
            state = self.board.sender_check_in(
                request.group, request.member_id, world_size=request.world_size, backend=request.backend,
                master_address=request.master_address, master_port=request.master_port,
                policy_version=request.policy_version, failed_generation=request.failed_generation,
            )
            self._notify()
            log.info("rendezvous_sender", group=request.group, generation=state.generation,
                     policy_version=request.policy_version, world_size=state.world_size)
            checked_in_as, answered = state, False
            try:
                while True:
                    ready, progress = self.board.sender_ready(request.group, request.policy_version, checked_in_as)
                    if ready:
                        state = self.board.group(request.group) or state  # a member's failure report may have bumped it
                        answered = True
                        break
                    if time.monotonic() >= deadline:
                        raise DeadlineExceeded(f"rendezvous of group {request.group!r}: only {progress} within {budget:.0f}s")
                    await self._wait_change(deadline)
            finally:
                # unanswered (a deadline, a cancelled call), the sender joins no generation: a
                # later one's receivers wait for its next check-in
                self.board.sender_done(request.group, checked_in_as, request.policy_version, answered=answered)
                self._notify()
            return param_server_pb2.RendezvousResponse(
                rank=0, world_size=state.world_size, master_address=state.master_address,
                master_port=state.master_port, backend=state.backend, generation=state.generation,
                policy_version=request.policy_version, delta_base_version=state.delta_base(request.policy_version),
            )
        if request.role == "probe":
            require_role(context, TRAINER, "Rendezvous as the sender's probe")
            if not request.group:
                raise InvalidArgument("group", "required (the collective group name)")
            return param_server_pb2.RendezvousResponse(
                policy_version=request.policy_version,
                wanted_again=self.board.wanted_again(request.group, request.policy_version),
            )
        if request.role != "receiver":
            raise InvalidArgument("role", f"{request.role!r}; use sender, receiver or probe")
        while True:
            got, changed = self.board.receiver_check_in(
                request.group, request.member_id, backend=request.backend, world_size=request.world_size,
                policy_version=request.policy_version, failed_generation=request.failed_generation,
                delta_base_version=request.delta_base_version,
            )
            if changed:
                self._notify()
            if got is not None:
                return param_server_pb2.RendezvousResponse(
                    rank=got.rank, world_size=got.world_size, master_address=got.master_address,
                    master_port=got.master_port, backend=got.backend, generation=got.generation,
                    policy_version=got.policy_version,
                )
            if time.monotonic() >= deadline:
                self.board.withdraw(request.group, request.member_id, request.policy_version)
                raise DeadlineExceeded(
                    f"rendezvous of group {request.group!r}: the sender did not reach version "
                    f"{request.policy_version} within {budget:.0f}s"
                )
            try:
                await self._wait_change(deadline)
            except asyncio.CancelledError:  # the receiver gave the version up: it must not count for the sender
                self.board.withdraw(request.group, request.member_id, request.policy_version)
                self._notify()
                raise

    async def _wait_change(self, deadline: float) -> None:
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except TimeoutError:
            pass


def _abort_when_written(loop: asyncio.AbstractEventLoop, upload: Upload) -> Callable[[object], None]:
    """A write's done-callback (in the io thread): abort the upload on its loop."""
    def done(_: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing left to give back
            loop.call_soon_threadsafe(upload.abort)
    return done
