"""The `nccl` / `hccl` (and `gloo`, for CPU) transport: a broadcast from the trainer's rank 0 to
the rollout ranks of the same device kind, the group formed through the param server.

One code path for every backend; services/common/device.py maps the backend to the device kind
(nccl: cuda, hccl: npu via torch_npu, gloo: cpu). The group is a private process group over its
own TCPStore (never the default group, which the trainer's FSDP owns).

Ordering. Receivers must be in the broadcast while the sender is, but rollouts hear of a version
from the coordinator, after the trainer commits it. So the sender first announces the version
(`announce(ref)`, wired to the trainer's CommitVersion), then waits at the param server's
rendezvous until every receiver checked in for that version, then broadcasts; `publish` then
returns the very ref it announced, so the trainer's usual CommitVersion afterwards is a no-op
re-commit (and a retried publish of the same version re-announces harmlessly). `announce`
returning False means no receiver will come (the run is stopping: the rollouts have left the
version stream); the sender then skips the broadcast rather than wait out its deadline. Without
`announce`, receivers must be told of the version some other way (tests, benchmarks). Every
receiver of a group takes part in every version: one that skips a version stalls the sender
until its deadline (then the group re-forms).

Steady groups. Once a version went through, both sides start the next one on the same group at
once, their rendezvous RPCs in the background (they keep the param server's board current; a new
generation or an error there sends the next version through the rendezvous again). CTRL(0) checks
that every receiver asked for the version the sender broadcasts (sums of v and v^2), so a
receiver on another version fails the version on every side at the first step, not at a deadline.

Steps. A version goes out as steps t = 0, 1, ...; each step is one CTRL all-reduce (sum of
int64[14 + K]: the sender's header, which also announces the next step's kind and size, and for a
DATA step the K fingerprint columns of its bucket, computed on the device; plus the receivers'
verdicts) then, for a DATA step, one broadcast of a slot: the bucket's bytes followed by its
metadata (a serialized Manifest). The host never waits for the device except to read a CTRL
header, and both sides post a step ahead of the wire, so that between two buckets the wire idles
only for one small all-reduce:

    sender    posts CTRL(t) and DATA(t) together, then packs b(t+1) (announced in CTRL(t)) into a
              free slot while DATA(t) is on the wire; reads CTRL(t) (done once DATA(t-1) is off
              the wire) and posts CTRL(t+1) and DATA(t+1), deciding (and announcing) step t+2
    receiver  reads CTRL(t) while DATA(t) is on the wire (its receive was posted from CTRL(t-1)'s
              announcement) and at once posts CTRL(t+1) and DATA(t+1); CTRL(t+1) carries the
              verdict on b(t-1), computed on the device (a side stream sums b(t-1)'s columns as
              soon as it landed and compares them with the sender's from CTRL(t-1); the comm
              stream waits for that, the host does not); then the host queues the check of b(t)
              and hands b(t-1), checked on the host too, to the consumer

A receiver's verdict on bucket t rides in CTRL(t+2), or in CTRL(t+1) when CTRL(t) announced no
DATA (the last bucket: it is checked at once, so the end costs two control steps; both sides
build the manifest's checksum meanwhile). The sender keeps a bucket in its slot until every
receiver acked it (4 slots: three in flight, one being packed; the receiver has 3) and sends a
NACKed one again (up to max_attempts, then ABORT and DataLoss everywhere). DONE comes once every bucket is acked and carries the manifest checksum, which
receivers compare with the manifest they assembled. Pinned host buffers are kept per slot and per
step ring, never allocated per step. Every wait polls against the deadline: a stuck peer gives
DeadlineExceeded, the group is aborted and re-formed (a new generation) at the next version.

Wire buckets. Whatever size the trainer gathers buckets in (update_weights_bucket_megabytes,
2048 by default), they travel as runs of their tensors of at most WIRE_BUCKET_BYTES (512 MiB; a
larger tensor alone): with bigger buckets the first one's pack and the last one's check, which
nothing overlaps, cost ~1.5 ms per GiB (0.76 of a raw broadcast at 2048 MiB, 0.70 at 4096, against
0.85 split; BENCHMARKS.md), and the slots would take 4x the bucket size on the trainer.

The sender plans its first two buckets and packs the first while its rendezvous RPC runs. It
returns its slots to the device allocator after each version (the trainer's steps use them). It
registers the manifest at the param server in the background (the RPC takes ~4 ms): `publish`
returns when the broadcast is done, and the next publish and `close` wait for the registration
(its error surfaces there). scripts/gpu/weights_trace.py shows where the time goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.v1 import common_pb2
from meshrl.v1 import param_server_pb2 as pb
from services.common.device import backend_device_kind, import_torch_npu
from services.common.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    MissingDependency,
    Unavailable,
)
from services.common.logging import get_logger

from .. import convert
from ..buffers import ByteBuffers
from ..client import ParamServerClient
from ..layout import (
    FINGERPRINT_COLUMNS,
    BucketMeta,
    TensorMeta,
    build_manifest,
    digest_columns,
    fingerprint_columns_async,
    pack_into,
    round_up,
    unpack,
)
from ..protocols import Bucket, Buckets, drain
from .base import Deadline, ManifestBuilder, PlannedBucket, plan_buckets, split_buckets

log = get_logger(__name__)

WIRE_BUCKET_BYTES = 512 << 20  # buckets travel in runs of tensors of at most this (a larger tensor alone)
SEND_SLOTS = 4  # the sender keeps a bucket until every receiver acked it (up to 3 in flight) + 1 to pack
RECV_SLOTS = 3  # the receiver: one being consumed, one on the wire, one posted ahead
RING = 4  # pinned header buffers, by step: one is rewritten only after its copy completed
# CTRL words: this step's kind, bucket index, padded bytes, metadata bytes; the receivers' verdict on
# step t-2 (W_NACK); version; the manifest checksum (DONE, 2 words); the next step's kind and slot
# bytes; the receivers' verdict on step t-1 (W_NACK_NOW: only when step t was announced as no DATA);
# a spare word; in CTRL(0), the sum of the versions the receivers asked for and of their squares
# (all equal to the sender's exactly when both sums are n*v and n*v^2)
CTRL_WORDS = 14
W_NACK, W_NEXT_KIND, W_NEXT_SIZE, W_NACK_NOW, W_JOIN, W_JOIN_SQ = 4, 8, 9, 10, 12, 13
DATA, FLUSH, DONE, ABORT = 1, 2, 3, 4


def device_kind(backend: str) -> str:
    try:
        return backend_device_kind(backend)
    except ValueError:
        raise InvalidArgument("actor_rollout_ref.rollout.checkpoint_engine.backend",
                              f"{backend!r} is not a collective backend (nccl, hccl, gloo)") from None


class _Device:
    """Streams, events and host copies for one device kind; on CPU everything is synchronous."""

    def __init__(self, backend: str) -> None:
        self.kind = device_kind(backend)
        if self.kind == "npu":
            import_torch_npu()  # fails fast with what to install
        if self.kind == "cpu":
            self.mod: Any = None
            self.device = torch.device("cpu")
            return
        self.mod = getattr(torch, self.kind)
        if not self.mod.is_available():
            raise MissingDependency(f"{self.kind} device", f"the {backend} transport needs a visible {self.kind} device")
        self.device = torch.device(self.kind, self.mod.current_device())
        self.comm_stream = self.mod.Stream(device=self.device)
        self.verify_stream = self.mod.Stream(device=self.device)
        self.host_stream = self.mod.Stream(device=self.device)  # small reads of finished results only
        self._pinned: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def accelerator(self) -> bool:
        return self.mod is not None

    def comm(self) -> contextlib.AbstractContextManager[Any]:
        """Context for launching collectives (they then wait only for what this stream waits for)."""
        return self.mod.stream(self.comm_stream) if self.accelerator else contextlib.nullcontext()

    def verify(self) -> contextlib.AbstractContextManager[Any]:
        return self.mod.stream(self.verify_stream) if self.accelerator else contextlib.nullcontext()

    def after_default(self) -> None:
        """Order the comm stream after everything queued so far on the default stream (buffer reuse)."""
        if self.accelerator:
            self.comm_stream.wait_stream(self.mod.current_stream(self.device))

    def pinned(self, key: tuple[str, int], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host buffer kept for `key` (grown on demand), instead of a pinned allocation
        per step. Callers key them by slot or by step modulo RING, so that a buffer is rewritten
        only after its last copy completed."""
        buf = self._pinned.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=True)
            self._pinned[key] = buf
        return buf[:numel]

    def read_later(self, t: torch.Tensor, work: Any, key: tuple[str, int]) -> tuple[torch.Tensor, Any]:
        """Queue a copy of `t`, the output of the collective `work`, to host memory for when the
        work finishes; returns (host tensor, event). Read it after `work` completed and the event
        synchronized (on CPU: the tensor itself, no event)."""
        if not self.accelerator:
            return t, None
        with self.mod.stream(self.host_stream):
            work.wait()  # the host stream (not the host) waits for the collective
            host = self.pinned(key, t.numel(), t.dtype)
            host.copy_(t, non_blocking=True)
            event = self.mod.Event()
            event.record()
        t.record_stream(self.host_stream)
        return host, event

    def from_host(self, values: list[int], key: tuple[str, int]) -> torch.Tensor:
        """int64 values as a tensor to copy to the device (non_blocking) on the current stream."""
        if not self.accelerator:
            return torch.tensor(values, dtype=torch.int64)
        host = self.pinned(key, len(values), torch.int64)
        host.numpy()[:] = values
        return host

    def bytes_from_host(self, data: bytes, key: tuple[str, int]) -> torch.Tensor:
        if not self.accelerator:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        host = self.pinned(key, len(data), torch.uint8)
        host.numpy()[:] = memoryview(data)
        return host

    def pinned_copy(self, t: torch.Tensor, key: tuple[str, int]) -> torch.Tensor:
        """Start copying `t` into host memory on the current stream (read it after an event)."""
        if not self.accelerator:
            return t
        host = self.pinned(key, t.numel(), t.dtype)
        host.copy_(t.reshape(-1), non_blocking=True)
        return host

    def record(self) -> Any:
        """An event after the current stream's work so far (None on CPU: already done)."""
        if not self.accelerator:
            return None
        event = self.mod.Event()
        event.record()
        return event

    def synchronize(self) -> None:
        if self.accelerator:
            self.mod.synchronize(self.device)


def _make_backend(backend: str, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    import_torch_npu()
    return dist.ProcessGroupHCCL(store, rank, size, timeout)  # type: ignore[attr-defined]


class _Group:
    """A private process group: broadcast from rank 0 and sum all-reduce, as async waits. (A
    second communicator for CTRL, so that it need not queue behind a bucket, was tried on 2 H100s:
    no faster, since the receiver's host work per bucket is the limit, and the stuck-peer test
    then hung in NCCL's watchdog; one communicator it is.)"""

    def __init__(self, backend: str, store: Any, rank: int, size: int, generation: int, timeout_s: float,
                 dev: _Device) -> None:
        self.backend = backend
        self.rank = rank
        self.size = size
        self.generation = generation
        self.dev = dev
        self.store = store
        if dev.accelerator:
            dev.mod.set_device(dev.device)  # this may run in a worker thread (device is per thread)
        self.pg = _make_backend(backend, store, rank, size, datetime.timedelta(seconds=timeout_s))
        self.broken = False
        # One tiny all-reduce forms the communicator here (NCCL/HCCL create it lazily, blocking the
        # caller), inside the caller's deadline-bounded thread rather than on the event loop later.
        warm = torch.zeros(1, dtype=torch.int64, device=dev.device)
        self.allreduce_sum(warm).wait()
        dev.synchronize()

    def broadcast(self, t: torch.Tensor) -> Any:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        with self.dev.comm():
            return self.pg.broadcast([t], opts)

    def allreduce_sum(self, t: torch.Tensor) -> Any:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        with self.dev.comm():
            return self.pg.allreduce([t], opts)

    async def wait(self, work: Any, deadline: Deadline, doing: str) -> None:
        """Poll until `work` completes; a spin on accelerators (µs matter), short sleeps on CPU."""
        spins = 0
        while not work.is_completed():
            if deadline.expired():
                self.abort()
                raise deadline.stalled(doing, deadline.timeout_s)
            spins += 1
            await asyncio.sleep(0 if self.dev.accelerator or spins < 100 else 0.001)
        try:
            work.wait()
        except RuntimeError as exc:  # a peer failed or left mid-collective
            self.abort()
            raise Unavailable(f"{deadline.what}: {doing} failed ({exc}); the group re-forms at the next version") from exc

    async def wait_event(self, event: Any, deadline: Deadline, doing: str) -> None:
        """Poll a device event (None: nothing to wait for) against the deadline."""
        if event is None:
            return
        while not event.query():
            if deadline.expired():
                self.abort()
                raise deadline.stalled(doing, deadline.timeout_s)
            await asyncio.sleep(0)

    def abort(self) -> None:
        self.broken = True
        for name in ("abort", "shutdown"):
            fn = getattr(self.pg, name, None)
            if fn is not None:
                with contextlib.suppress(Exception):
                    fn()
                return


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _checksum_words(checksum: str) -> tuple[int, int]:
    return _signed(int(checksum[:16], 16)), _signed(int(checksum[16:32], 16))


class _CollectiveBase:
    def __init__(self, backend: str, address: str, *, group: str, timeout_s: float, member_id: str,
                 slots: int) -> None:
        self.backend = backend
        self.dev = _Device(backend)
        self.address = address
        self.group_name = group
        self.timeout_s = timeout_s
        self.member_id = member_id
        self.client = ParamServerClient(address)
        self.group: _Group | None = None
        self.slots = ByteBuffers(slots, self.dev.device)
        # The group finished the last version: the next one starts on it at once, its rendezvous
        # RPC in the background (_check_in_later); the param server's wait would add ~2 ms.
        self._steady = False
        self._rejoin = False  # a background check-in saw a new generation or failed
        self._checking: asyncio.Task[None] | None = None

    def _pg_timeout_s(self) -> float:
        return self.timeout_s + 60.0

    async def _build_group(self, store: Any, rank: int, size: int, generation: int, deadline: Deadline) -> _Group:
        import torch.distributed as dist

        prefix = dist.PrefixStore(f"meshrl/{self.group_name}/{generation}", store)
        build = asyncio.to_thread(_Group, self.backend, prefix, rank, size, generation, self._pg_timeout_s(), self.dev)
        try:
            return await asyncio.wait_for(build, timeout=max(deadline.remaining(), 0.001))
        except TimeoutError:
            raise deadline.stalled(f"forming the {self.backend} group {self.group_name!r}", deadline.timeout_s) from None

    def drop_group(self) -> None:
        self._steady = False
        if self._checking is not None:  # the check-in of a version that failed is moot
            self._checking.cancel()
        if self.group is not None:
            self.group.abort()
        self.group = None

    def _steady_group(self) -> _Group | None:
        """The group to start the next version on without waiting at the rendezvous, if any."""
        if self._steady and not self._rejoin and self.group is not None and not self.group.broken:
            return self.group
        self._steady = self._rejoin = False
        return None

    async def _check_in_later(self, request: pb.RendezvousRequest, group: _Group) -> None:
        """A steady group's rendezvous for this version, in the background: it keeps the param
        server's board current (who is at which version); a new generation or an error there makes
        the next version wait at the rendezvous and re-form the group."""
        try:
            resp = await self.client.rendezvous(request, timeout_s=max(self.timeout_s, 1.0))
            if resp.generation != group.generation:
                self._rejoin = True
        except (MeshError, OSError) as exc:  # the broadcast checks its peers; this decides the next start
            log.warning("rendezvous_check_in_failed", group=self.group_name, policy_version=request.policy_version,
                        error=str(exc))
            self._rejoin = True

    async def _checked_in(self) -> None:
        task, self._checking = self._checking, None
        if task is not None:
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this caller was cancelled, not the check-in

    def _check_join(self, words: list[int], receivers: int, version: int) -> None:
        """CTRL(0): every receiver asked for the sender's version (else all sides fail at once)."""
        if words[W_JOIN] != receivers * version or words[W_JOIN_SQ] != receivers * version * version:
            raise FailedPrecondition(
                f"group {self.group_name!r}: the sender broadcasts version {words[5]} but not every one of its "
                f"{receivers} receivers asked for version {version} (a receiver skipped or repeated a version; "
                "the group re-forms at the next version)"
            )

    async def close(self) -> None:
        self.drop_group()
        await self._checked_in()
        await self.client.close()


@dataclass
class _SendRecord:
    index: int
    slot: int
    nbytes: int
    padded: int
    meta_len: int  # the bucket's metadata (a serialized Manifest) follows its bytes in the slot
    metas: list[TensorMeta]
    columns: torch.Tensor  # the fingerprint columns of the slot's bytes, on the device
    columns_host: torch.Tensor  # ... copied to host memory once `columns_ready`
    columns_ready: Any
    attempts: int = 1


@dataclass
class _Step:
    t: int
    kind: int
    rec: _SendRecord | None
    ctrl: torch.Tensor  # keeps the device tensor alive until read
    work: Any
    header: torch.Tensor  # CTRL's header words, in host memory once `read` fired
    read: Any
    nxt: _Next
    manifest: Any = None


@dataclass
class _Next:
    """What step t+1 will send, decided when step t is posted, so that CTRL(t) tells the receivers
    the size of DATA(t+1) and they post its receive while DATA(t) is on the wire: a bucket (`rec`:
    packed right after step t was posted, or NACKed and sent again) or nothing (a control step)."""

    rec: _SendRecord | None = None
    resend: bool = False
    planned: Any = None  # a new bucket, until packed into `slot`
    slot: int = -1
    meta: bytes = b""

    @property
    def data(self) -> bool:
        return self.rec is not None or self.planned is not None

    def size(self) -> int:
        if self.rec is not None:
            return self.rec.padded + self.rec.meta_len
        if self.planned is not None:
            return round_up(self.planned.nbytes, 8) + len(self.meta)
        return 0


class CollectivePublisher(_CollectiveBase):
    """Trainer rank 0: broadcasts versions to the group's receivers. On an accelerator, set the
    process's current device (torch.cuda.set_device) before constructing it."""

    def __init__(
        self,
        backend: str,
        address: str,
        *,
        receivers: int,
        group: str = "rollout",
        master_address: str = "127.0.0.1",
        timeout_s: float = 300.0,
        max_attempts: int = 3,
        announce: Callable[[common_pb2.WeightsRef], Awaitable[bool | None]] | None = None,
        member_id: str = "",
        corrupt_hook: Callable[[int, torch.Tensor], None] | None = None,
        wire_bucket_bytes: int = WIRE_BUCKET_BYTES,
    ) -> None:
        super().__init__(backend, address, group=group, timeout_s=timeout_s,
                         member_id=member_id or f"sender-{uuid.uuid4().hex[:8]}", slots=SEND_SLOTS)
        if receivers < 1:
            raise InvalidArgument("param_server.collective_receivers", f"must be >= 1, got {receivers}")
        self.receivers = receivers
        self.master_address = master_address
        self.max_attempts = max_attempts
        self.announce = announce
        self._store: Any = None
        self._registering: asyncio.Task[Any] | None = None
        self._meta_cache: dict[tuple[TensorMeta, ...], bytes] = {}
        self.resent_buckets = 0
        self._corrupt_hook = corrupt_hook  # tests: damage a packed slot after its fingerprint is taken
        self.wire_bucket_bytes = wire_bucket_bytes

    @property
    def transport(self) -> str:
        return self.backend

    async def _ensure_group(self, version: int, deadline: Deadline) -> _Group:
        import torch.distributed as dist

        if self.group is not None and self.group.broken:
            self.drop_group()
        if self._store is None or self.group is None:
            self._store = await asyncio.to_thread(
                dist.TCPStore, self.master_address, 0, self.receivers + 1, True,
                datetime.timedelta(seconds=self._pg_timeout_s()), False,
            )
        req = self._rendezvous_request(version)
        resp = await self.client.rendezvous(req, timeout_s=max(deadline.check("rendezvous"), 0.001))
        if self.group is None or self.group.generation != resp.generation:
            self.drop_group()
            self.group = await self._build_group(self._store, 0, resp.world_size, resp.generation, deadline)
        return self.group

    def _rendezvous_request(self, version: int) -> pb.RendezvousRequest:
        return pb.RendezvousRequest(
            group=self.group_name, role="sender", member_id=self.member_id, world_size=self.receivers + 1,
            master_address=self.master_address, master_port=self._store.port, backend=self.backend,
            policy_version=version,
        )

    async def settle(self) -> None:
        """Wait for what the last publish left running: its rendezvous check-in and its manifest
        registration (whose error surfaces here)."""
        await self._checked_in()
        task, self._registering = self._registering, None
        if task is not None:
            await task

    async def publish(self, version: int, buckets: Buckets) -> common_pb2.WeightsRef:
        await self.settle()
        deadline = Deadline(self.timeout_s, f"{self.backend} broadcast of version {version} (group {self.group_name!r})")
        announced = common_pb2.WeightsRef(policy_version=version, param_server_address=self.address)
        if self.announce is not None and await self.announce(announced) is False:
            drained = await drain(buckets)  # the export runs to its end on every rank
            log.warning("broadcast_skipped", transport=self.backend, policy_version=version, buckets=drained,
                        reason="the run is stopping: no rollout will load this version")
            return announced
        steady = self._steady_group()
        group: asyncio.Future[_Group]
        if steady is not None:
            group = asyncio.get_running_loop().create_future()
            group.set_result(steady)
            self._checking = asyncio.create_task(self._check_in_later(self._rendezvous_request(version), steady))
        else:  # the rendezvous RPC runs while the first buckets are planned and packed
            group = asyncio.ensure_future(self._ensure_group(version, deadline))
        try:
            planned = plan_buckets(split_buckets(buckets, self.wire_bucket_bytes)).__aiter__()
            manifest = await self._send(group, version, planned, deadline)
        except BaseException:
            group.cancel()
            with contextlib.suppress(BaseException):
                await group
            self.drop_group()
            self._store = None
            raise
        self._steady = True
        if self.dev.accelerator:  # every broadcast is done: the trainer's next steps may use the
            self.slots.release()  # slots' memory (the caching allocator hands it back at the next publish)
        self._registering = asyncio.create_task(self.client.register(manifest, timeout_s=max(self.timeout_s, 1.0)))
        log.info("weights_published", transport=self.backend, policy_version=version, total_bytes=manifest.total_bytes,
                 buckets=len(manifest.buckets), resent=self.resent_buckets)
        if self.announce is not None:
            return announced  # the same ref: the trainer's CommitVersion after publish is a no-op re-commit
        return convert.weights_ref(manifest, self.address)

    async def close(self) -> None:
        try:
            await self.settle()
        finally:
            await super().close()

    def _pack(self, slot: int, planned: Any, meta: bytes) -> _SendRecord:
        """Queue the copies of a bucket's tensors into a slot, its fingerprint columns and their
        copy to host memory on the current stream, and its metadata to the device; nothing here
        waits for the device."""
        padded = round_up(planned.nbytes, 8)
        buf = self.slots.get(slot, padded + len(meta))
        if padded > planned.nbytes:
            buf[planned.nbytes : padded].zero_()
        pack_into(buf, planned.named, planned.metas)
        buf[padded:].copy_(self.dev.bytes_from_host(meta, ("meta", slot)), non_blocking=True)
        columns = fingerprint_columns_async(buf, planned.nbytes)
        if self._corrupt_hook is not None:
            self._corrupt_hook(planned.index, buf)
        return _SendRecord(planned.index, slot, planned.nbytes, padded, len(meta), list(planned.metas), columns,
                           self.dev.pinned_copy(columns, ("columns", slot)), self.dev.record())

    def _meta_bytes(self, version: int, planned: Any) -> bytes:
        """The bucket's metadata as a serialized Manifest. Its tensors part is the same for every
        version of a model (cached); concatenated serializations parse as one merged message."""
        key = tuple(planned.metas)
        tensors = self._meta_cache.get(key)
        if tensors is None:
            msg = pb.Manifest()
            msg.tensors.extend(convert.manifest_to_proto(build_manifest(0, planned.metas, [])).tensors)
            tensors = msg.SerializeToString()
            if len(self._meta_cache) > 4096:
                self._meta_cache.clear()
            self._meta_cache[key] = tensors
        head = pb.Manifest(policy_version=version,
                           buckets=[convert.bucket_to_proto(BucketMeta(planned.index, planned.nbytes, ""))])
        return head.SerializeToString() + tensors

    def _ctrl(self, t: int, header: list[int], columns: torch.Tensor | None) -> torch.Tensor:
        ctrl = torch.zeros(CTRL_WORDS + FINGERPRINT_COLUMNS, dtype=torch.int64, device=self.dev.device)
        ctrl[:CTRL_WORDS].copy_(self.dev.from_host(header, ("header_out", t % RING)), non_blocking=True)
        if columns is not None:
            ctrl[CTRL_WORDS:].copy_(columns)
        return ctrl

    async def _send(self, group_ready: asyncio.Future[_Group], version: int, planned_iter: AsyncIterator[Any],
                    deadline: Deadline) -> Any:
        """Step t's CTRL and bytes are posted together, one step ahead of the host: the host reads
        CTRL(t) (done once DATA(t-1) is off the wire) while DATA(t) is on it, then posts step t+1
        (announced in CTRL(t), packed while DATA(t) was on the wire), deciding step t+2 (announced
        in CTRL(t+1)) and packing it. A bucket keeps its slot until every receiver acked it; a
        NACKed one is sent again from its slot."""
        dev = self.dev
        builder = ManifestBuilder(version)
        held: dict[int, _SendRecord | None] = {}  # slot -> its bucket until acked (None: reserved for the next)
        resend: list[_SendRecord] = []  # NACKed, to send again
        failed: list[_SendRecord] = []  # NACKed max_attempts times: the next control step is ABORT
        verdicts: dict[tuple[int, int], _SendRecord] = {}  # (step, CTRL word) -> the bucket whose verdict it carries
        works: dict[int, Any] = {}  # slot -> its last broadcast
        state = {"exhausted": False}
        pending: list[_SendRecord] = []  # first sends (in bucket order) whose fingerprints the manifest lacks
        groups: list[_Group] = []
        built: list[Any] = []  # the manifest, built once the last fingerprint is in (before DONE)

        async def digest_ready(wait: bool) -> None:
            while pending and (wait or pending[0].columns_ready is None or pending[0].columns_ready.query()):
                r = pending.pop(0)
                await groups[0].wait_event(r.columns_ready, deadline, "fingerprinting a bucket")  # sent: a group exists
                builder.add(PlannedBucket(r.index, [], r.metas, r.nbytes), digest_columns(r.columns_host, r.nbytes))

        async def decide() -> _Next:
            """The step after the one being posted: a resend first, else the next bucket if a slot
            is free, else a control step."""
            if failed:
                return _Next()
            if resend:
                return _Next(rec=resend.pop(0), resend=True)
            free = [s for s in range(SEND_SLOTS) if s not in held]
            if state["exhausted"] or not free:
                return _Next()
            planned = await anext(planned_iter, None)
            if planned is None:
                state["exhausted"] = True
                return _Next()
            held[free[0]] = None
            return _Next(planned=planned, slot=free[0], meta=self._meta_bytes(version, planned))

        async def pack(nxt: _Next) -> None:
            if nxt.planned is None:
                return
            if nxt.slot in works:  # the slot's last send must be off the wire (it was acked: it is)
                await groups[0].wait(works.pop(nxt.slot), deadline, "sending a bucket")
            if any(r.slot == nxt.slot for r in pending):  # its host copy of the columns is reused
                await digest_ready(wait=True)
            nxt.rec = held[nxt.slot] = self._pack(nxt.slot, nxt.planned, nxt.meta)
            nxt.planned = None

        async def post(t: int, cur: _Next) -> _Step:
            nxt = await decide()
            rec = cur.rec
            if cur.resend:
                assert rec is not None
                rec.attempts += 1
                self.resent_buckets += 1
                log.warning("bucket_nacked_resending", policy_version=version, bucket=rec.index, attempt=rec.attempts)
            if rec is not None:
                kind = DATA
            elif failed:
                kind = ABORT
            elif state["exhausted"] and not held and not resend:
                kind = DONE
            else:
                kind = FLUSH
            header = [kind, rec.index if rec else 0, rec.padded if rec else 0, rec.meta_len if rec else 0,
                      0, version, 0, 0, DATA if nxt.data else 0, nxt.size()] + [0] * (CTRL_WORDS - 10)
            manifest = None
            if kind == DONE:
                if not built:
                    await digest_ready(wait=True)
                    built.append(builder.build([self.backend]))
                manifest = built[0]
                header[6], header[7] = _checksum_words(manifest.checksum)
            ctrl = self._ctrl(t, header, rec.columns if rec is not None else None)
            if not groups:  # the first step was packed while the rendezvous ran
                groups.append(await group_ready)
            group = groups[0]
            dev.after_default()
            work = group.allreduce_sum(ctrl)
            step = _Step(t, kind, rec, ctrl, work, *dev.read_later(ctrl[:CTRL_WORDS], work, ("header_in", t % RING)),
                         nxt, manifest)
            if rec is not None:
                works[rec.slot] = group.broadcast(self.slots.get(rec.slot, rec.padded + rec.meta_len))
                if rec.attempts == 1:
                    pending.append(rec)
                # the receivers report on a bucket two steps later, or at once when no DATA follows
                verdicts[(t + 2, W_NACK) if nxt.data else (t + 1, W_NACK_NOW)] = rec
            await pack(nxt)  # while DATA(t) is on the wire
            await digest_ready(wait=False)
            if state["exhausted"] and not pending and not built:  # while the last steps are on the wire
                built.append(builder.build([self.backend]))
            return step

        await asyncio.sleep(0)  # the rendezvous RPC starts before the first bucket is gathered and packed
        first = await decide()
        await pack(first)
        step = await post(0, first)
        group = groups[0]
        while True:
            t = step.t
            await group.wait(step.work, deadline, f"step {t} control exchange")
            due = [(w, verdicts.pop((t, w))) for w in (W_NACK, W_NACK_NOW) if (t, w) in verdicts]
            if due or t == 0:
                await group.wait_event(step.read, deadline, f"step {t} control exchange")
            if t == 0:
                self._check_join(step.header.tolist(), self.receivers, version)
            for w, rec in due:
                if not int(step.header[w]):
                    del held[rec.slot]  # every receiver has it: the slot is free
                elif rec.attempts >= self.max_attempts:
                    failed.append(rec)
                else:
                    resend.append(rec)
            if step.kind == ABORT:
                raise DataLoss(f"version {version}: bucket {failed[0].index} failed its checksum on a receiver "
                               f"{failed[0].attempts} times (param_server.max_fetch_attempts={self.max_attempts})")
            if step.kind == DONE:
                for w in works.values():
                    await group.wait(w, deadline, "finishing the broadcast")
                return step.manifest
            step = await post(t + 1, step.nxt)


@dataclass
class _RecvRecord:
    t: int
    index: int
    slot: int
    nbytes: int
    meta_len: int  # the metadata follows the bucket's bytes in the slot
    expected: torch.Tensor  # the sender's fingerprint columns: CTRL(t)'s tail, on the device
    data_work: Any
    bad: torch.Tensor | None = None  # int64[1] on the device: 1 if the columns differ from `expected`
    meta_host: torch.Tensor | None = None
    columns_host: torch.Tensor | None = None
    bad_host: torch.Tensor | None = None
    landed: Any = None  # event: the bucket arrived, was checked, and its columns reached host memory


class CollectiveFetcher(_CollectiveBase):
    """A rollout rank: receives versions broadcast in its group (into its current device; the
    yielded tensors are views of a receive buffer, valid until the next bucket is requested)."""

    def __init__(
        self,
        backend: str,
        address: str,
        *,
        consumer_id: str,
        group: str = "rollout",
        timeout_s: float = 300.0,
        corrupt_hook: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> None:
        if not consumer_id:
            raise InvalidArgument("consumer_id", "required (a stable id of this rank)")
        super().__init__(backend, address, group=group, timeout_s=timeout_s, member_id=consumer_id, slots=RECV_SLOTS)
        self._corrupt_hook = corrupt_hook  # tests: damage received bytes (step, bucket, buffer)
        self.nacks_sent = 0

    @property
    def transport(self) -> str:
        return self.backend

    def _rendezvous_request(self, version: int) -> pb.RendezvousRequest:
        return pb.RendezvousRequest(group=self.group_name, role="receiver", member_id=self.member_id,
                                    backend=self.backend, policy_version=version)

    async def _ensure_group(self, version: int, deadline: Deadline) -> _Group:
        import torch.distributed as dist

        req = self._rendezvous_request(version)
        try:
            resp = await self.client.rendezvous(req, timeout_s=max(deadline.check("rendezvous"), 0.001))
        except DeadlineExceeded as exc:  # the sender never came to this version
            raise deadline.stalled(f"waiting at the param server's rendezvous for the sender of version {version}",
                                   deadline.timeout_s) from exc
        if self.group is not None and (self.group.broken or self.group.generation != resp.generation):
            self.drop_group()
        if self.group is None:
            store = await asyncio.to_thread(
                dist.TCPStore, resp.master_address, resp.master_port, resp.world_size, False,
                datetime.timedelta(seconds=max(deadline.remaining(), 1.0)),
            )
            self.group = await self._build_group(store, resp.rank, resp.world_size, resp.generation, deadline)
        return self.group

    async def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Bucket]:
        version = ref.policy_version
        await self._checked_in()
        deadline = Deadline(self.timeout_s, f"{self.backend} receive of version {version} (group {self.group_name!r})")
        group = self._steady_group()
        if group is not None:
            self._checking = asyncio.create_task(self._check_in_later(self._rendezvous_request(version), group))
        else:
            group = await self._ensure_group(version, deadline)
        done = False
        try:
            async for bucket in self._receive(group, version, deadline):
                yield bucket
            done = True
            self._steady = True
        finally:
            if not done:
                self.drop_group()  # a broken-off receive leaves the group out of step: re-form it

    def _post_ctrl(self, group: _Group, t: int, nack: _RecvRecord | None,
                   nack_now: _RecvRecord | None, version: int = 0) -> tuple[torch.Tensor, Any, torch.Tensor, Any]:
        """Post CTRL(t) carrying the device-side verdicts on buckets `nack` (step t-2) and
        `nack_now` (step t-1; the comm stream waits for their checks, the host does not), or in
        CTRL(0) the version asked for, and queue the read of its header: (ctrl, work, header in
        host memory, event)."""
        dev = self.dev
        with dev.comm():  # not behind the consumer's work on the default stream
            ctrl = torch.zeros(CTRL_WORDS + FINGERPRINT_COLUMNS, dtype=torch.int64, device=dev.device)
            if version:
                words = [0] * CTRL_WORDS
                words[W_JOIN], words[W_JOIN_SQ] = version, version * version
                ctrl[:CTRL_WORDS].copy_(dev.from_host(words, ("header_out", t % RING)), non_blocking=True)
            for word, rec in ((W_NACK, nack), (W_NACK_NOW, nack_now)):
                if rec is not None:
                    assert rec.bad is not None
                    if dev.accelerator:
                        dev.comm_stream.wait_event(rec.landed)
                        rec.bad.record_stream(dev.comm_stream)
                    ctrl[word : word + 1].copy_(rec.bad)
        work = group.allreduce_sum(ctrl)
        return ctrl, work, *dev.read_later(ctrl[:CTRL_WORDS], work, ("header_in", t % RING))

    async def _land(self, group: _Group, rec: _RecvRecord, deadline: Deadline) -> None:
        """Queue the check of a bucket on a side stream: it waits for the bucket, sums its columns,
        compares them with the sender's (`rec.bad`, read by the next CTRL on the device) and copies
        columns, verdict and metadata to host memory, then records an event; the host does not wait
        here (on CPU it all happens at once)."""
        dev = self.dev
        buf = self.slots.get(rec.slot, rec.nbytes + rec.meta_len)
        if self._corrupt_hook is not None or not dev.accelerator:
            await group.wait(rec.data_work, deadline, f"receiving step {rec.t}")
            if self._corrupt_hook is not None:
                self._corrupt_hook(rec.t, rec.index, buf)
                dev.synchronize()  # the damage lands before the verify stream reads the slot
        with dev.verify():
            if dev.accelerator:
                rec.data_work.wait()
                rec.expected.record_stream(dev.verify_stream)  # allocated on the comm stream, read here
            columns = fingerprint_columns_async(buf, rec.nbytes)  # zero padding: the same columns
            rec.bad = (columns != rec.expected).any().to(torch.int64).reshape(1)
            rec.columns_host = dev.pinned_copy(columns, ("columns", rec.slot))
            rec.bad_host = dev.pinned_copy(rec.bad, ("bad", rec.slot))
            rec.meta_host = dev.pinned_copy(buf[rec.nbytes : rec.nbytes + rec.meta_len], ("meta", rec.slot))
            rec.landed = dev.record()

    async def _verify(self, group: _Group, rec: _RecvRecord, deadline: Deadline) -> tuple[bool, pb.Manifest]:
        """(whether the bucket arrived intact, its metadata with the fingerprint filled in)."""
        await group.wait_event(rec.landed, deadline, f"receiving step {rec.t}")
        assert rec.meta_host is not None and rec.columns_host is not None and rec.bad_host is not None
        if int(rec.bad_host[0]):
            return False, pb.Manifest()
        meta = pb.Manifest.FromString(rec.meta_host.numpy().tobytes())
        if len(meta.buckets) != 1 or meta.buckets[0].index != rec.index or round_up(meta.buckets[0].nbytes, 8) != rec.nbytes:
            # the bytes match the sender's fingerprint, so the sender's own header disagrees with them
            raise DataLoss(f"step {rec.t}: the bucket's metadata disagrees with its control header "
                           "(the peers disagree on the protocol)")
        meta.buckets[0].fingerprint = digest_columns(rec.columns_host, meta.buckets[0].nbytes)
        return True, meta

    async def _receive(self, group: _Group, version: int, deadline: Deadline) -> AsyncIterator[Bucket]:
        """Reads CTRL(t) while DATA(t) is on the wire (its receive was posted when CTRL(t-1) said
        how big it is) and at once posts CTRL(t+1), carrying the device-side verdict on bucket t-1,
        and DATA(t+1); then queues the check of bucket t and hands bucket t-1 to the consumer. When
        CTRL(t) says no DATA follows, bucket t is checked first and its verdict rides in CTRL(t+1)
        too."""
        dev = self.dev
        unreported: dict[int, _RecvRecord] = {}  # data steps whose verdict no CTRL carried yet
        ahead: dict[int, tuple[Any, int]] = {}  # step -> (its DATA receive, posted before CTRL(step) was read; bytes)
        tensors: dict[int, list[TensorMeta]] = {}
        buckets: dict[int, BucketMeta] = {}
        assembled: dict[int, Any] = {}  # {bucket count: manifest}, built while waiting for DONE

        def manifest() -> Any:
            if len(buckets) not in assembled:
                assembled.clear()
                assembled[len(buckets)] = build_manifest(version, [x for i in sorted(tensors) for x in tensors[i]],
                                                         [buckets[i] for i in sorted(buckets)])
            return assembled[len(buckets)]

        t = 0
        ctrl, work, header, read = self._post_ctrl(group, 0, None, None, version)
        while True:
            await group.wait(work, deadline, f"step {t} control exchange")
            await group.wait_event(read, deadline, f"step {t} control exchange")
            words = header.tolist()
            kind, index, nbytes, meta_len, _, sender_version, csum_a, csum_b, next_kind, next_size = words[:10]
            if sender_version != version:
                raise FailedPrecondition(f"the group is broadcasting version {sender_version}, expected {version}")
            if t == 0:
                self._check_join(words, group.size - 1, version)
            if kind == ABORT:
                raise DataLoss(f"version {version}: the sender gave up on a bucket that kept failing its checksum")
            rec = None
            if kind == DATA:
                slot = t % RECV_SLOTS
                posted = ahead.pop(t, None)
                if posted is None:
                    dev.after_default()  # the consumer has finished with the slot's previous bucket
                    posted = group.broadcast(self.slots.get(slot, nbytes + meta_len)), nbytes + meta_len
                if posted[1] != nbytes + meta_len:
                    raise DataLoss(f"version {version}: step {t} was announced as {posted[1]} bytes and "
                                   f"carries {nbytes + meta_len} (the peers disagree on the protocol)")
                rec = unreported[t] = _RecvRecord(t, index, slot, nbytes, meta_len, ctrl[CTRL_WORDS:], posted[0])
            report = [unreported.pop(t - 1, None), None]  # the verdicts CTRL(t+1) carries
            if rec is not None and next_kind != DATA:
                await self._land(group, rec, deadline)
                report[1] = unreported.pop(t)
            if kind == DONE:
                if unreported or report[0] is not None:
                    raise DataLoss(f"version {version}: the sender finished before this receiver reported on "
                                   f"steps {sorted(unreported) or [t - 1]} (the peers disagree on the protocol)")
                got = manifest()
                if _checksum_words(got.checksum) != (csum_a, csum_b):
                    raise DataLoss(f"version {version}: the received buckets do not add up to the sender's manifest")
                log.info("weights_received", transport=self.backend, policy_version=version,
                         total_bytes=got.total_bytes, buckets=len(buckets))
                return
            ctrl, work, header, read = self._post_ctrl(group, t + 1, report[0], report[1])
            if next_kind == DATA:
                dev.after_default()  # the consumer has finished with the slot's previous bucket
                ahead[t + 1] = group.broadcast(self.slots.get((t + 1) % RECV_SLOTS, next_size)), next_size
            if rec is not None and report[1] is None:
                await self._land(group, rec, deadline)
            for done in report:
                if done is None:
                    continue
                ok, meta = await self._verify(group, done, deadline)
                if not ok:
                    self.nacks_sent += 1
                    log.warning("bucket_corrupt_nacked", policy_version=version, bucket=done.index, step=done.t)
                elif done.index not in buckets:
                    m = convert.manifest_from_proto(meta)
                    tensors[done.index], buckets[done.index] = list(m.tensors), m.buckets[0]
                    yield unpack(self.slots.get(done.slot, done.nbytes), m.tensors)
            if kind != DATA and next_kind != DATA and not unreported and buckets:
                manifest()  # no DATA in flight: what DONE will be checked against, while CTRL(t+1) runs
            t += 1
