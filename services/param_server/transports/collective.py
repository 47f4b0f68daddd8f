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
re-commit (and a retried publish of the same version re-announces harmlessly). Without
`announce`, receivers must be told of the version some other way (tests, benchmarks). Every
receiver of a group takes part in every version: one that skips a version stalls the sender
until its deadline (then the group re-forms).

Steps. A version goes out as steps t = 0, 1, ...; each step is one CTRL all-reduce (sum of
int64[8 + K]: the sender's header and, for a DATA step, the K fingerprint columns of its bucket,
computed on the device; plus the receivers' NACK of step t-2), then for a DATA step one broadcast
of slot t % 3 of three device buffers: the bucket's bytes followed by its metadata (a serialized
Manifest). The host never waits for the device except to read a CTRL header, and each side posts
ahead of the wire:

    sender    posts CTRL(t) and DATA(t) together; reads CTRL(t) (done once DATA(t-1) is off the
              wire) while DATA(t) is on it; packs b(t+1) into the slot CTRL(t) just freed, posts
              CTRL(t+1) and DATA(t+1)
    receiver  reads CTRL(t) (a copy to pinned memory queued behind it), posts DATA(t); checks
              b(t-1) (its columns, summed on a side stream as soon as it landed, against the
              sender's from CTRL(t-1)); posts CTRL(t+1) with nack(t-1); the consumer loads b(t-1)

so between two buckets the wire idles for one small all-reduce and the receiver's read of the next
header, as long as each side's host work per bucket fits in the bucket's time on the wire (on 2
H100s the receiver's, ~1 ms of Python per bucket, is the limit at 512 MiB). Pinned host buffers
are kept per slot and per step ring, never allocated per step. A bucket that fails its fingerprint on any receiver is NACKed and sent again from its slot
(up to max_attempts, then ABORT and DataLoss everywhere). FLUSH steps drain the last acks; DONE
carries the manifest checksum, which receivers compare with the manifest they assembled. Every wait
polls against the deadline: a stuck peer gives DeadlineExceeded, the group is aborted and re-formed
(a new generation) at the next version.

The sender registers the manifest at the param server in the background (the RPC takes ~4 ms):
`publish` returns when the broadcast is done, and the next publish and `close` wait for the
registration (its error surfaces there). scripts/gpu/weights_trace.py shows where the time goes.
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
from services.common.device import collective_backend, import_torch_npu
from services.common.errors import DataLoss, FailedPrecondition, InvalidArgument, MissingDependency, Unavailable
from services.common.logging import get_logger

from .. import convert
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
from .base import Bucket, Buckets, Deadline, ManifestBuilder, PlannedBucket, plan_buckets

log = get_logger(__name__)

SLOTS = 3
LAG = SLOTS - 1  # CTRL(t) carries the receivers' verdict on step t - LAG
RING = 4  # pinned header buffers, by step: one is rewritten only after its copy completed
CTRL_WORDS = 8  # kind, bucket index, padded bytes, metadata bytes, nacks, version, checksum (2 words)
DATA, FLUSH, DONE, ABORT = 1, 2, 3, 4
_KIND_OF = {"nccl": "cuda", "hccl": "npu", "gloo": "cpu"}


def device_kind(backend: str) -> str:
    if backend not in _KIND_OF:
        raise InvalidArgument("actor_rollout_ref.rollout.checkpoint_engine.backend",
                              f"{backend!r} is not a collective backend (nccl, hccl, gloo)")
    kind = _KIND_OF[backend]
    assert collective_backend(kind) == backend
    return kind


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


class _Slots:
    """Three device byte buffers, grown on demand."""

    def __init__(self, dev: _Device) -> None:
        self.dev = dev
        self.bufs: list[torch.Tensor | None] = [None] * SLOTS

    def get(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self.bufs[slot]
        if buf is None or buf.numel() < nbytes:
            self.bufs[slot] = None
            buf = torch.empty(max(nbytes, 8), dtype=torch.uint8, device=self.dev.device)
            self.bufs[slot] = buf
        return buf[:nbytes]


class _CollectiveBase:
    def __init__(self, backend: str, address: str, *, group: str, timeout_s: float, member_id: str) -> None:
        self.backend = backend
        self.dev = _Device(backend)
        self.address = address
        self.group_name = group
        self.timeout_s = timeout_s
        self.member_id = member_id
        self.client = ParamServerClient(address)
        self.group: _Group | None = None
        self.slots = _Slots(self.dev)

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
        if self.group is not None:
            self.group.abort()
        self.group = None

    async def close(self) -> None:
        self.drop_group()
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
    manifest: Any = None


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
        announce: Callable[[common_pb2.WeightsRef], Awaitable[None]] | None = None,
        member_id: str = "",
        corrupt_hook: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__(backend, address, group=group, timeout_s=timeout_s, member_id=member_id or f"sender-{uuid.uuid4().hex[:8]}")
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
        req = pb.RendezvousRequest(
            group=self.group_name, role="sender", member_id=self.member_id, world_size=self.receivers + 1,
            master_address=self.master_address, master_port=self._store.port, backend=self.backend,
            policy_version=version,
        )
        resp = await self.client.rendezvous(req, timeout_s=max(deadline.check("rendezvous"), 0.001))
        if self.group is None or self.group.generation != resp.generation:
            self.drop_group()
            self.group = await self._build_group(self._store, 0, resp.world_size, resp.generation, deadline)
        return self.group

    async def _registered(self) -> None:
        """Wait for the previous version's manifest registration (its error surfaces here)."""
        task, self._registering = self._registering, None
        if task is not None:
            await task

    async def publish(self, version: int, buckets: Buckets) -> common_pb2.WeightsRef:
        deadline = Deadline(self.timeout_s, f"{self.backend} broadcast of version {version} (group {self.group_name!r})")
        await self._registered()
        announced = common_pb2.WeightsRef(policy_version=version, param_server_address=self.address)
        if self.announce is not None:
            await self.announce(announced)
        group = await self._ensure_group(version, deadline)
        try:
            manifest = await self._send(group, version, plan_buckets(buckets).__aiter__(), deadline)
        except BaseException:
            self.drop_group()
            self._store = None
            raise
        self._registering = asyncio.create_task(self.client.register(manifest, timeout_s=max(self.timeout_s, 1.0)))
        log.info("weights_published", transport=self.backend, policy_version=version, total_bytes=manifest.total_bytes,
                 buckets=len(manifest.buckets), resent=self.resent_buckets)
        if self.announce is not None:
            return announced  # the same ref: the trainer's CommitVersion after publish is a no-op re-commit
        return common_pb2.WeightsRef(policy_version=version, param_server_address=self.address,
                                     manifest_checksum=manifest.checksum, total_bytes=manifest.total_bytes)

    async def close(self) -> None:
        try:
            await self._registered()
        finally:
            await super().close()

    def _pack(self, slot: int, planned: Any, version: int) -> _SendRecord:
        """Queue the copies of a bucket's tensors into a slot, its fingerprint columns and their
        copy to host memory on the current stream, and its metadata to the device; nothing here
        waits for the device."""
        meta = self._meta_bytes(version, planned)
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

    async def _send(self, group: _Group, version: int, planned_iter: AsyncIterator[Any], deadline: Deadline) -> Any:
        """Step t's CTRL, metadata and bytes are posted together, one step ahead of the host: the
        host reads CTRL(t) (done once DATA(t-1) is off the wire) while DATA(t) is on it, then
        decides and posts step t+1 from what CTRL(t) said."""
        dev = self.dev
        builder = ManifestBuilder(version)
        sent: dict[int, _SendRecord] = {}  # data step -> record, while its slot may be resent
        nacked: set[int] = set()
        unacked: set[int] = set()
        works: dict[int, Any] = {}  # data step -> its broadcast
        state = {"exhausted": False}
        pending: list[_SendRecord] = []  # first sends (in bucket order) whose fingerprints the manifest lacks

        async def digest_ready(wait: bool) -> None:
            while pending and (wait or pending[0].columns_ready is None or pending[0].columns_ready.query()):
                r = pending.pop(0)
                await group.wait_event(r.columns_ready, deadline, "fingerprinting a bucket")
                builder.add(PlannedBucket(r.index, [], r.metas, r.nbytes), digest_columns(r.columns_host, r.nbytes))

        async def post(t: int) -> _Step:
            """Decide step t from what is known after CTRL(t-1) and post it."""
            slot = t % SLOTS
            prev = sent.pop(t - SLOTS, None)
            kind, rec = FLUSH, None
            if prev is not None and (t - SLOTS) in nacked:
                prev.attempts += 1
                self.resent_buckets += 1
                kind, rec = (ABORT, prev) if prev.attempts > self.max_attempts else (DATA, prev)
                log.warning("bucket_nacked_resending", policy_version=version, bucket=prev.index, attempt=prev.attempts)
            elif not state["exhausted"]:
                planned = await anext(planned_iter, None)
                if planned is None:
                    state["exhausted"] = True
                else:
                    if (t - SLOTS) in works:  # the slot's last send must be off the wire
                        await group.wait(works.pop(t - SLOTS), deadline, "sending a bucket")
                    if any(r.slot == slot for r in pending):  # its host copy of the columns is reused
                        await digest_ready(wait=True)
                    kind, rec = DATA, self._pack(slot, planned, version)
            if kind == FLUSH and state["exhausted"] and not unacked:
                kind = DONE
            header = [kind, rec.index if rec else 0, rec.padded if rec else 0, rec.meta_len if rec else 0,
                      0, version, 0, 0]
            manifest = None
            if kind == DONE:
                await digest_ready(wait=True)
                manifest = builder.build([self.backend])
                header[6], header[7] = _checksum_words(manifest.checksum)
            ctrl = self._ctrl(t, header, rec.columns if kind == DATA and rec is not None else None)
            dev.after_default()
            work = group.allreduce_sum(ctrl)
            step = _Step(t, kind, rec, ctrl, work, *dev.read_later(ctrl[:CTRL_WORDS], work, ("header_in", t % RING)), manifest)
            if kind == DATA:
                assert rec is not None
                works.pop(t - SLOTS, None)
                works[t] = group.broadcast(self.slots.get(rec.slot, rec.padded + rec.meta_len))
                if rec.attempts == 1:
                    pending.append(rec)
                sent[t] = rec
                unacked.add(t)
            await digest_ready(wait=False)  # while the bytes are on the wire
            return step

        step = await post(0)
        while True:
            t = step.t
            await group.wait(step.work, deadline, f"step {t} control exchange")
            if (t - LAG) in unacked:
                unacked.discard(t - LAG)
                await group.wait_event(step.read, deadline, f"step {t} control exchange")
                if int(step.header[4]):
                    nacked.add(t - LAG)
            if step.kind == ABORT:
                assert step.rec is not None
                raise DataLoss(f"version {version}: bucket {step.rec.index} failed its checksum on a receiver "
                               f"{step.rec.attempts - 1} times (param_server.max_fetch_attempts={self.max_attempts})")
            if step.kind == DONE:
                for w in works.values():
                    await group.wait(w, deadline, "finishing the broadcast")
                return step.manifest
            step = await post(t + 1)


@dataclass
class _RecvRecord:
    t: int
    index: int
    slot: int
    nbytes: int
    meta_len: int  # the metadata follows the bucket's bytes in the slot
    expected: torch.Tensor  # the sender's fingerprint columns: CTRL(t)'s tail, on the device
    data_work: Any
    meta_host: torch.Tensor | None = None
    columns_host: torch.Tensor | None = None
    expected_host: torch.Tensor | None = None
    landed: Any = None  # event: the bucket arrived and its columns reached host memory


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
        super().__init__(backend, address, group=group, timeout_s=timeout_s, member_id=consumer_id)
        self._corrupt_hook = corrupt_hook  # tests: damage received bytes (step, bucket, buffer)
        self.nacks_sent = 0

    @property
    def transport(self) -> str:
        return self.backend

    async def _ensure_group(self, version: int, deadline: Deadline) -> _Group:
        import torch.distributed as dist

        req = pb.RendezvousRequest(group=self.group_name, role="receiver", member_id=self.member_id,
                                   backend=self.backend, policy_version=version)
        resp = await self.client.rendezvous(req, timeout_s=max(deadline.check("rendezvous"), 0.001))
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
        deadline = Deadline(self.timeout_s, f"{self.backend} receive of version {version} (group {self.group_name!r})")
        group = await self._ensure_group(version, deadline)
        done = False
        try:
            async for bucket in self._receive(group, version, deadline):
                yield bucket
            done = True
        finally:
            if not done:
                self.drop_group()  # a broken-off receive leaves the group out of step: re-form it

    def _post_ctrl(self, group: _Group, t: int, nack: int) -> tuple[torch.Tensor, Any, torch.Tensor, Any]:
        """Post CTRL(t) and queue the read of its header: (ctrl, work, header in host memory, event)."""
        with self.dev.comm():  # not behind the consumer's work on the default stream
            ctrl = torch.zeros(CTRL_WORDS + FINGERPRINT_COLUMNS, dtype=torch.int64, device=self.dev.device)
            if nack:
                ctrl[:CTRL_WORDS].copy_(self.dev.from_host([0, 0, 0, 0, nack, 0, 0, 0], ("header_out", t % RING)),
                                        non_blocking=True)
        work = group.allreduce_sum(ctrl)
        return ctrl, work, *self.dev.read_later(ctrl[:CTRL_WORDS], work, ("header_in", t % RING))

    async def _land(self, group: _Group, rec: _RecvRecord, deadline: Deadline) -> None:
        """On an accelerator: a side stream waits for the bucket, sums its columns and copies them
        and the metadata to host memory, then records an event; the host does not wait here."""
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
            nbytes = rec.nbytes  # padded with zeros by the sender: the columns are the same
            rec.columns_host = dev.pinned_copy(fingerprint_columns_async(buf, nbytes), ("columns", rec.slot))
            rec.meta_host = dev.pinned_copy(buf[rec.nbytes : rec.nbytes + rec.meta_len], ("meta", rec.slot))
            rec.expected_host = dev.pinned_copy(rec.expected, ("expected", rec.slot))
            rec.landed = dev.record()

    async def _verify(self, group: _Group, rec: _RecvRecord, deadline: Deadline) -> tuple[bool, pb.Manifest]:
        await group.wait_event(rec.landed, deadline, f"receiving step {rec.t}")
        assert rec.meta_host is not None and rec.columns_host is not None and rec.expected_host is not None
        meta = pb.Manifest.FromString(rec.meta_host.numpy().tobytes())
        if len(meta.buckets) != 1:
            raise DataLoss("malformed bucket metadata in the broadcast")
        bucket = meta.buckets[0]
        fingerprint = digest_columns(rec.columns_host, bucket.nbytes)
        bucket.fingerprint = fingerprint
        ok = (fingerprint == digest_columns(rec.expected_host, bucket.nbytes) and round_up(bucket.nbytes, 8) == rec.nbytes
              and bucket.index == rec.index)
        return ok, meta

    async def _receive(self, group: _Group, version: int, deadline: Deadline) -> AsyncIterator[Bucket]:
        dev = self.dev
        records: dict[int, _RecvRecord] = {}
        tensors: dict[int, list[TensorMeta]] = {}
        buckets: dict[int, BucketMeta] = {}
        t = 0
        ctrl, work, header, read = self._post_ctrl(group, 0, 0)
        while True:
            await group.wait(work, deadline, f"step {t} control exchange")
            await group.wait_event(read, deadline, f"step {t} control exchange")
            words = header.tolist()
            kind, index, nbytes, meta_len, _, sender_version, csum_a, csum_b = words[:CTRL_WORDS]
            if sender_version != version:
                raise FailedPrecondition(f"the group is broadcasting version {sender_version}, expected {version}")
            if kind == ABORT:
                raise DataLoss(f"version {version}: the sender gave up on a bucket that kept failing its checksum")
            if kind == DATA:
                slot = t % SLOTS
                dev.after_default()  # the consumer has finished with the slot's previous bucket
                rec = _RecvRecord(t, index, slot, nbytes, meta_len, ctrl[CTRL_WORDS:],
                                  group.broadcast(self.slots.get(slot, nbytes + meta_len)))
                records[t] = rec
                await self._land(group, rec, deadline)
            nack, ready = 0, None
            done = records.pop(t - 1, None)  # arrived before CTRL(t) completed (one stream)
            if done is not None:
                ok, meta = await self._verify(group, done, deadline)
                got = meta.buckets[0].index
                if not ok:
                    nack = 1
                    self.nacks_sent += 1
                    log.warning("bucket_corrupt_nacked", policy_version=version, bucket=got, step=done.t)
                elif got not in buckets:
                    m = convert.manifest_from_proto(meta)
                    tensors[got], buckets[got] = list(m.tensors), m.buckets[0]
                    ready = (done, m)
            if kind == DONE:
                manifest = build_manifest(version, [x for i in sorted(tensors) for x in tensors[i]],
                                          [buckets[i] for i in sorted(buckets)])
                if _checksum_words(manifest.checksum) != (csum_a, csum_b):
                    raise DataLoss(f"version {version}: the received buckets do not add up to the sender's manifest")
                log.info("weights_received", transport=self.backend, policy_version=version,
                         total_bytes=manifest.total_bytes, buckets=len(buckets))
                return
            ctrl, work, header, read = self._post_ctrl(group, t + 1, nack)  # nack(t-1) rides in CTRL(t+1)
            if ready is not None:
                r, m = ready
                yield unpack(self.slots.get(r.slot, r.nbytes), m.tensors)
            t += 1
