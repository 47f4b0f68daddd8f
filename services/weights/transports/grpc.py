"""The `grpc` transport: chunked streaming straight through the param server. Works between any
two processes that can open a TCP connection: across device vendors (a GPU trainer feeding NPU
rollouts and the reverse) and across clusters.

    trainer: bucket i ──pack+fingerprint (thread; a bucket packed and fingerprinted by the
             export goes from its own buffer)──▶ BucketMeta, chunks ──▶ PublishWeights stream
                        (bucket i+1 packs while bucket i is on the wire; manifest last)
    server : copy + fingerprint each chunk, verify each bucket, version visible at the manifest
    rollout: AcquireVersion (pins it) ─▶ FetchWeights stream ─▶ copy + fingerprint (thread) ─▶
             verify ─▶ yield bucket (while the next one streams into the other buffer);
             a bucket that fails its fingerprint is fetched again (bucket_indices) ─▶ ReleaseVersion
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshrl.v1 import common_pb2
from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import DataLoss, InvalidArgument, Unavailable
from services.common.logging import get_logger

from .. import convert, hostmem
from ..buffers import ByteBuffers
from ..client import ParamServerClient
from ..layout import Fingerprinter, Manifest, fingerprint_bytes, host_view, pack_into, unpack, validate_manifest
from ..protocols import Bucket, Buckets
from ..wire import RawChunk
from .base import Deadline, ManifestBuilder, PlannedBucket, check_against_manifest, plan_buckets

log = get_logger(__name__)
MiB = 1 << 20
TRANSPORT = "grpc"


def _own_buffer(planned: PlannedBucket) -> torch.Tensor | None:
    """The bucket's own host buffer when its packer fingerprinted it (packing.py): streamed as it
    is, neither copied nor read before it goes."""
    packed = planned.packed
    return packed.buffer if packed is not None and packed.buffer.device.type == "cpu" else None


def _pack(planned: PlannedBucket, buf: torch.Tensor, sha: bool) -> tuple[str, str]:
    """Copy a bucket into `buf` (host) and checksum it (a bucket in its own buffer: its packer's
    fingerprint, the sha256 if asked). Runs in a worker thread."""
    if planned.packed is not None and buf is planned.packed.buffer:
        return planned.packed.fingerprint, hashlib.sha256(host_view(buf)).hexdigest() if sha else ""
    pack_into(buf, planned.named, planned.metas)
    if any(t.device.type != "cpu" for _, t in planned.named):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
    host = host_view(buf)
    return fingerprint_bytes(host), hashlib.sha256(host).hexdigest() if sha else ""


class GrpcPublisher:
    """Streams versions to the param server at `address`."""

    transport = TRANSPORT

    def __init__(
        self,
        address: str,
        *,
        chunk_bytes: int = 4 * MiB,
        timeout_s: float = 300.0,
        stall_timeout_s: float = 60.0,
        sha256: bool = False,
        application: str | None = None,
        max_message_bytes: int = 64 * MiB,
        tune_malloc: bool = True,
    ) -> None:
        if tune_malloc:
            hostmem.tune_malloc()
        self.address = address
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.sha256 = sha256
        self.client = ParamServerClient(address, application=application, max_message_bytes=max_message_bytes)
        self._bufs = ByteBuffers(2)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-pack")

    async def close(self) -> None:
        await self.client.close()
        self._io.shutdown(wait=False)

    async def publish(self, version: int, buckets: Buckets) -> common_pb2.WeightsRef:
        deadline = Deadline(self.timeout_s, f"publish of version {version} to {self.address}")
        builder = ManifestBuilder(version)
        last_progress = [time.monotonic()]
        loop = asyncio.get_running_loop()

        def start(planned: PlannedBucket | None, slot: int) -> tuple[PlannedBucket, torch.Tensor, asyncio.Future[Any]] | None:
            if planned is None:
                return None
            own = _own_buffer(planned)
            buf = own if own is not None else self._bufs.get(slot, planned.nbytes)
            return planned, buf, loop.run_in_executor(self._io, _pack, planned, buf, self.sha256)

        failed: list[BaseException] = []

        async def items() -> AsyncIterator[Any]:
            try:
                async for item in _items():
                    yield item
            except BaseException as exc:
                failed.append(exc)  # grpc.aio cancels the call and the caller sees only CancelledError
                raise

        async def _items() -> AsyncIterator[Any]:
            planned_iter = plan_buckets(buckets).__aiter__()
            slot = 0
            pending = start(await anext(planned_iter, None), slot)
            while pending is not None:
                planned, buf, fut = pending
                fingerprint, sha = await fut
                last_progress[0] = time.monotonic()
                meta = builder.add(planned, fingerprint, sha)
                slot ^= 1
                pending = start(await anext(planned_iter, None), slot)  # packs while this bucket is on the wire
                yield pb.PublishWeightsRequest(bucket=convert.bucket_to_proto(meta))
                view = host_view(buf)
                for off in range(0, planned.nbytes, self.chunk_bytes):
                    yield RawChunk(version, planned.index, off, view[off : off + self.chunk_bytes])
                    last_progress[0] = time.monotonic()
            manifest = builder.build([TRANSPORT])
            yield pb.PublishWeightsRequest(manifest=convert.manifest_to_proto(manifest))

        call = asyncio.ensure_future(self.client.publish(items(), timeout_s=deadline.remaining()))
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=min(self.stall_timeout_s, max(deadline.remaining(), 0.01)))
                if done:
                    if failed and (call.cancelled() or call.exception() is not None):
                        raise failed[0]  # the export failed (e.g. a rank died): that is the cause
                    resp = call.result()
                    break
                if time.monotonic() - last_progress[0] > self.stall_timeout_s or deadline.expired():
                    raise deadline.stalled("streaming buckets to the param server", self.stall_timeout_s)
        finally:
            if not call.done():
                call.cancel()
                with contextlib.suppress(BaseException):
                    await call
        manifest = builder.build([TRANSPORT])
        log.info("weights_published", transport=TRANSPORT, policy_version=version, total_bytes=resp.total_bytes,
                 buckets=len(builder.buckets), server_s=round(resp.publish_s, 3))
        return convert.weights_ref(manifest, self.address)


@dataclass
class _Incoming:
    index: int
    buffer: torch.Tensor
    slot: int
    fingerprint: Fingerprinter
    sha: Any
    received: int = 0


def _ingest(cur: _Incoming, offset: int, data: memoryview) -> None:
    if len(data):
        cur.buffer.numpy()[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
    cur.fingerprint.update(offset, data)
    if cur.sha is not None:
        cur.sha.update(data)


async def _stop(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and wait until it has ended. Cancelled again until it has: Python 3.11's
    wait_for loses a cancellation that arrives as its inner call completes (gh-86296), and the
    stream task would then block on its next buffer, never ending (seen: 2 runs in 5)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled():
        task.exception()  # retrieved: its consumer is gone


class GrpcFetcher:
    """Fetches versions from the param server named in the ref (or `address`)."""

    transport = TRANSPORT

    def __init__(
        self,
        address: str = "",
        *,
        consumer_id: str,
        chunk_bytes: int = 4 * MiB,
        timeout_s: float = 300.0,
        stall_timeout_s: float = 60.0,
        max_attempts: int = 3,
        names: Iterable[str] | None = None,
        application: str | None = None,
        max_message_bytes: int = 64 * MiB,
        tune_malloc: bool = True,
    ) -> None:
        if tune_malloc:
            hostmem.tune_malloc()
        if not consumer_id:
            raise InvalidArgument("consumer_id", "required (a stable id of this consumer, e.g. the replica id)")
        self.address = address
        self.consumer_id = consumer_id
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.max_attempts = max_attempts
        self.names = set(names) if names else None
        self.application = application
        self.max_message_bytes = max_message_bytes
        self._clients: dict[str, ParamServerClient] = {}
        self._bufs = ByteBuffers(2)
        self._producer: asyncio.Future[None] | None = None  # the stream writing into _bufs
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fetch-copy")
        self.refetched_buckets = 0

    def _client(self, address: str) -> ParamServerClient:
        if address not in self._clients:
            self._clients[address] = ParamServerClient(
                address, application=self.application, max_message_bytes=self.max_message_bytes
            )
        return self._clients[address]

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._io.shutdown(wait=False)

    async def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Bucket]:
        address = ref.param_server_address or self.address
        if not address:
            raise InvalidArgument("ref.param_server_address", "empty and the fetcher has no default address")
        version = ref.policy_version
        deadline = Deadline(self.timeout_s, f"fetch of version {version} from {address}")
        client = self._client(address)
        manifest = await client.acquire(self.consumer_id, version, timeout_s=deadline.check("AcquireVersion"))
        version = manifest.policy_version  # a negative ref version asked for the newest: the one pinned
        try:
            check_against_manifest(manifest, ref, f"fetch from {address}")  # a mismatch releases the hold too
            try:  # the fingerprints cover the bytes; the checksum covers where each tensor lies in them
                validate_manifest(manifest)
            except InvalidArgument as exc:
                raise DataLoss(f"fetch of version {version} from {address}: the manifest AcquireVersion answered "
                               f"does not check out ({exc})") from None
            todo = manifest.buckets_for_names(self.names) if self.names else list(range(len(manifest.buckets)))
            attempts = dict.fromkeys(todo, 0)
            first = True
            while todo:
                bad: list[int] = []
                # closed with this generator: an abandoned stream's producer must not write into
                # the buffers the next fetch reads (it ran on until garbage collection)
                async with contextlib.aclosing(self._stream(client, manifest, todo, deadline, whole=first)) as stream:
                    async for index, buffer, ok in stream:
                        if not ok:
                            bad.append(index)
                            continue
                        metas = manifest.bucket_tensors(index)
                        if self.names is not None:
                            metas = [m for m in metas if m.name in self.names]
                        yield unpack(buffer, metas)
                first = False
                for i in bad:
                    attempts[i] += 1
                    if attempts[i] >= self.max_attempts:
                        raise DataLoss(
                            f"fetch of version {version}: bucket {i} failed its checksum {attempts[i]} times "
                            f"(param_server.max_fetch_attempts={self.max_attempts})"
                        )
                    log.warning("bucket_corrupt_refetching", policy_version=version, bucket=i, attempt=attempts[i])
                self.refetched_buckets += len(bad)
                todo = bad
        finally:
            with contextlib.suppress(Exception):
                await client.release(self.consumer_id, version, timeout_s=5.0)

    async def _stream(
        self, client: ParamServerClient, manifest: Manifest, buckets: list[int], deadline: Deadline, *, whole: bool
    ) -> AsyncGenerator[tuple[int, torch.Tensor, bool], None]:
        """Stream `buckets`; yields (index, buffer, verified). The buffer is reused two buckets on."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        free = asyncio.Semaphore(2)
        request = pb.FetchWeightsRequest(policy_version=manifest.policy_version, chunk_bytes=self.chunk_bytes)
        if not whole or self.names is not None:
            request.bucket_indices.extend(buckets)
        earlier = self._producer
        if earlier is not None and not earlier.done():
            # A stream abandoned and not yet closed (its fetch was dropped mid-version) writes
            # into the same two buffers: it stops before this one starts.
            await _stop(earlier)
        call = client.fetch(request, timeout_s=max(deadline.remaining(), 0.001))
        producer = self._producer = asyncio.ensure_future(self._produce(call, manifest, buckets, deadline, queue, free))
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                index, buffer, ok = item
                yield index, buffer, ok
                free.release()  # the consumer asked for the next bucket: it is done with this one
        finally:
            call.cancel()
            await _stop(producer)

    async def _produce(self, call: Any, manifest: Manifest, buckets: list[int], deadline: Deadline,
                       queue: asyncio.Queue[Any], free: asyncio.Semaphore) -> None:
        loop = asyncio.get_running_loop()
        want_sha = any(manifest.buckets[i].sha256 for i in buckets)
        slot = 0
        try:
            it = call.__aiter__()
            cur: _Incoming | None = None
            seen: set[int] = set()

            async def finish(c: _Incoming) -> None:
                meta = manifest.buckets[c.index]
                ok = c.received == meta.nbytes and c.fingerprint.hexdigest() == meta.fingerprint
                if ok and c.sha is not None and meta.sha256:
                    ok = c.sha.hexdigest() == meta.sha256
                await queue.put((c.index, c.buffer, ok))

            async def begin(index: int) -> _Incoming:
                nonlocal slot
                await free.acquire()
                buf = self._bufs.get(slot, manifest.buckets[index].nbytes)
                c = _Incoming(index, buf, slot, Fingerprinter(manifest.buckets[index].nbytes),
                              hashlib.sha256() if want_sha else None)
                slot ^= 1
                seen.add(index)
                return c

            header = True
            while True:
                wait_s = min(self.stall_timeout_s, deadline.remaining())
                try:
                    msg = await asyncio.wait_for(it.__anext__(), timeout=max(wait_s, 0.001))
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise deadline.stalled(f"receiving version {manifest.policy_version}", self.stall_timeout_s) from None
                if header:
                    header = False
                    if isinstance(msg, RawChunk) or msg.WhichOneof("item") != "manifest":
                        raise DataLoss("FetchWeights stream did not start with the manifest")
                    got = convert.manifest_from_proto(msg.manifest)
                    if got.checksum != manifest.checksum:
                        raise DataLoss(f"version {manifest.policy_version} changed between AcquireVersion and FetchWeights")
                    continue
                chunk = msg if isinstance(msg, RawChunk) else RawChunk.from_proto(msg.chunk)
                if cur is None or chunk.bucket_index != cur.index:
                    if cur is not None:
                        await finish(cur)
                    for i in buckets:  # empty buckets carry no chunks
                        if i not in seen and manifest.buckets[i].nbytes == 0 and i < chunk.bucket_index:
                            await finish(await begin(i))
                    if chunk.bucket_index not in buckets or chunk.bucket_index in seen:
                        raise DataLoss(f"unexpected chunk of bucket {chunk.bucket_index}")
                    cur = await begin(chunk.bucket_index)
                n = len(chunk.data)
                if chunk.offset != cur.received or cur.received + n > manifest.buckets[cur.index].nbytes:
                    raise DataLoss(f"bucket {cur.index}: chunk at {chunk.offset}+{n}, expected offset {cur.received}")
                cur.received += n
                await loop.run_in_executor(self._io, _ingest, cur, chunk.offset, chunk.data)
            if cur is not None:
                await finish(cur)
            for i in buckets:
                if i not in seen:
                    if manifest.buckets[i].nbytes:
                        raise DataLoss(f"FetchWeights ended before bucket {i} of version {manifest.policy_version}")
                    await finish(await begin(i))
            await queue.put(None)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the consumer is done with the stream
            # grpc.aio raises CancelledError when the call itself was cancelled here (its channel
            # closed): the consumer waits on the queue, so it must hear of it
            await queue.put(Unavailable(f"FetchWeights(version={manifest.policy_version}) was cancelled: the channel "
                                        "to the param server closed"))
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer, which raises it
            import grpc

            if isinstance(exc, grpc.aio.AioRpcError):
                from ..client import raise_rpc_error

                try:
                    raise_rpc_error(exc, f"FetchWeights(version={manifest.policy_version})")
                except Exception as mapped:  # noqa: BLE001
                    exc = mapped
            await queue.put(exc)
