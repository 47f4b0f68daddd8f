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
int64[8]: the sender's header + the receivers' NACK of step t-2), then for a DATA step the bucket's
metadata and bytes (broadcasts) into slot t % 3 of three device buffers:

    sender   pack b(t+1) into its slot while b(t) is on the wire ─┐  (slots = 3 buckets of memory)
    receiver verify b(t-1) on a side stream while b(t) arrives ───┤  nack(t-2) rides in CTRL(t)
             the consumer loads b(t-2) (verified) meanwhile ──────┘

A bucket that fails its fingerprint on any receiver is NACKed and sent again from its slot (up to
max_attempts, then ABORT and DataLoss everywhere). FLUSH steps drain the last acks; DONE carries
the manifest checksum, which receivers compare with the manifest they assembled. Every wait polls
against the deadline: a stuck peer gives DeadlineExceeded, the group is aborted and re-formed (a
new generation) at the next version.
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
    BucketMeta,
    TensorMeta,
    build_manifest,
    digest_columns,
    fingerprint_columns_async,
    fingerprint_tensor,
    pack_into,
    round_up,
    unpack,
)
from .base import Bucket, Buckets, Deadline, ManifestBuilder, plan_buckets

log = get_logger(__name__)

SLOTS = 3
LAG = SLOTS - 1
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
    """Streams and syncs for one device kind; on CPU everything is synchronous."""

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

    @property
    def accelerator(self) -> bool:
        return self.mod is not None

    def comm(self) -> contextlib.AbstractContextManager[Any]:
        """Context for launching collectives (they then wait only for what this stream waits for)."""
        return self.mod.stream(self.comm_stream) if self.accelerator else contextlib.nullcontext()

    def after_default(self) -> None:
        """Order the comm stream after everything queued so far on the default stream (buffer reuse)."""
        if self.accelerator:
            self.comm_stream.wait_stream(self.mod.current_stream(self.device))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.accelerator:
            return t
        with self.mod.stream(self.verify_stream):
            return t.to("cpu")

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
    """A private process group: broadcast from rank 0 and sum all-reduce, as async waits."""

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
    padded: int
    meta_bytes: bytes
    attempts: int = 1


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

    async def publish(self, version: int, buckets: Buckets) -> common_pb2.WeightsRef:
        deadline = Deadline(self.timeout_s, f"{self.backend} broadcast of version {version} (group {self.group_name!r})")
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
        await self.client.register(manifest, timeout_s=max(deadline.remaining(), 1.0))
        log.info("weights_published", transport=self.backend, policy_version=version, total_bytes=manifest.total_bytes,
                 buckets=len(manifest.buckets), resent=self.resent_buckets)
        if self.announce is not None:
            return announced  # the same ref: the trainer's CommitVersion after publish is a no-op re-commit
        return common_pb2.WeightsRef(policy_version=version, param_server_address=self.address,
                                     manifest_checksum=manifest.checksum, total_bytes=manifest.total_bytes)

    def _pack(self, slot: int, planned: Any, builder: ManifestBuilder, version: int) -> _SendRecord:
        padded = round_up(planned.nbytes, 8)
        buf = self.slots.get(slot, padded)
        if padded > planned.nbytes:
            buf[planned.nbytes :].zero_()
        pack_into(buf, planned.named, planned.metas)
        fingerprint = fingerprint_tensor(buf, planned.nbytes)
        meta = builder.add(planned, fingerprint)
        if self._corrupt_hook is not None:
            self._corrupt_hook(planned.index, buf)
        msg = pb.Manifest(policy_version=version, buckets=[convert.bucket_to_proto(meta)])
        msg.tensors.extend(convert.manifest_to_proto(build_manifest(version, planned.metas, [meta])).tensors)
        return _SendRecord(planned.index, slot, padded, msg.SerializeToString())

    async def _send(self, group: _Group, version: int, planned_iter: AsyncIterator[Any], deadline: Deadline) -> Any:
        dev = self.dev
        builder = ManifestBuilder(version)
        sent: dict[int, _SendRecord] = {}  # data step -> record
        nacked: set[int] = set()
        unacked: set[int] = set()
        exhausted = False
        works: dict[int, list[Any]] = {}  # data step -> its broadcasts
        t = 0
        while True:
            slot = t % SLOTS
            prev = sent.get(t - SLOTS)
            kind, rec = FLUSH, None
            if prev is not None and (t - SLOTS) in nacked:
                prev.attempts += 1
                self.resent_buckets += 1
                kind, rec = (ABORT, None) if prev.attempts > self.max_attempts else (DATA, prev)
                log.warning("bucket_nacked_resending", policy_version=version, bucket=prev.index, attempt=prev.attempts)
            elif not exhausted:
                planned = await anext(planned_iter, None)
                if planned is None:
                    exhausted = True
                else:
                    for w in works.pop(t - SLOTS, []):  # the slot's last send must be off the wire
                        await group.wait(w, deadline, "sending a bucket")
                    kind, rec = DATA, self._pack(slot, planned, builder, version)
            if kind == FLUSH and exhausted and not unacked:
                kind = DONE
            header = [kind, rec.index if rec else 0, rec.padded if rec else 0, len(rec.meta_bytes) if rec else 0,
                      0, version, 0, 0]
            manifest = None
            if kind == DONE:
                manifest = builder.build([self.backend])
                header[6], header[7] = _checksum_words(manifest.checksum)
            dev.after_default()
            with dev.comm():
                ctrl = torch.tensor(header, dtype=torch.int64).to(dev.device)
            await group.wait(group.allreduce_sum(ctrl), deadline, f"step {t} control exchange")
            nack_count = int(dev.to_host(ctrl)[4])
            if (t - LAG) in unacked:
                unacked.discard(t - LAG)
                if nack_count:
                    nacked.add(t - LAG)
            if kind == ABORT:
                assert prev is not None
                raise DataLoss(f"version {version}: bucket {prev.index} failed its checksum on a receiver "
                               f"{prev.attempts - 1} times (param_server.max_fetch_attempts={self.max_attempts})")
            if kind == DONE:
                for step_works in works.values():
                    for w in step_works:
                        await group.wait(w, deadline, "finishing the broadcast")
                return manifest
            if kind == DATA:
                assert rec is not None
                with dev.comm():
                    meta = torch.frombuffer(bytearray(rec.meta_bytes), dtype=torch.uint8).to(dev.device)
                buf = self.slots.get(slot, rec.padded)
                works[t] = [group.broadcast(meta), group.broadcast(buf)]
                works.pop(t - SLOTS, None)
                sent[t] = rec
                sent.pop(t - SLOTS, None)
                unacked.add(t)
            t += 1


@dataclass
class _RecvRecord:
    slot: int
    nbytes: int
    meta: torch.Tensor
    meta_work: Any
    data_work: Any
    columns: torch.Tensor | None


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

    def _verify(self, rec: _RecvRecord) -> tuple[bool, pb.Manifest]:
        meta = pb.Manifest.FromString(self.dev.to_host(rec.meta).numpy().tobytes())
        if len(meta.buckets) != 1:
            raise DataLoss("malformed bucket metadata in the broadcast")
        bucket = meta.buckets[0]
        if rec.columns is not None:
            with self.dev.mod.stream(self.dev.verify_stream):
                fingerprint = digest_columns(rec.columns.tolist(), bucket.nbytes)
        else:
            fingerprint = fingerprint_tensor(self.slots.get(rec.slot, rec.nbytes), bucket.nbytes)
        return fingerprint == bucket.fingerprint and round_up(bucket.nbytes, 8) == rec.nbytes, meta

    async def _receive(self, group: _Group, version: int, deadline: Deadline) -> AsyncIterator[Bucket]:
        dev = self.dev
        records: dict[int, _RecvRecord] = {}
        tensors: dict[int, list[TensorMeta]] = {}
        buckets: dict[int, BucketMeta] = {}
        t = 0
        while True:
            nack, ready = 0, None
            rec = records.pop(t - LAG, None)
            if rec is not None:
                await group.wait(rec.meta_work, deadline, f"receiving step {t - LAG}")
                await group.wait(rec.data_work, deadline, f"receiving step {t - LAG}")
                ok, meta = self._verify(rec)
                index = meta.buckets[0].index
                if not ok:
                    nack = 1
                    self.nacks_sent += 1
                    log.warning("bucket_corrupt_nacked", policy_version=version, bucket=index, step=t - LAG)
                elif index not in buckets:
                    m = convert.manifest_from_proto(meta)
                    tensors[index], buckets[index] = list(m.tensors), m.buckets[0]
                    ready = (rec, m)
            dev.after_default()
            with dev.comm():
                ctrl = torch.tensor([0, 0, 0, 0, nack, 0, 0, 0], dtype=torch.int64).to(dev.device)
            await group.wait(group.allreduce_sum(ctrl), deadline, f"step {t} control exchange")
            kind, index, nbytes, meta_len, _, sender_version, csum_a, csum_b = (int(x) for x in dev.to_host(ctrl))
            if sender_version != version:
                raise FailedPrecondition(f"the group is broadcasting version {sender_version}, expected {version}")
            if kind == ABORT:
                raise DataLoss(f"version {version}: the sender gave up on a bucket that kept failing its checksum")
            if kind == DATA:
                slot = t % SLOTS
                with dev.comm():
                    meta_buf = torch.empty(meta_len, dtype=torch.uint8, device=dev.device)
                buf = self.slots.get(slot, nbytes)
                meta_work = group.broadcast(meta_buf)
                data_work = group.broadcast(buf)
                if self._corrupt_hook is not None:
                    await group.wait(data_work, deadline, "receiving (test hook)")
                    self._corrupt_hook(t, index, buf)
                    dev.synchronize()  # the damage lands before the verify stream reads the slot
                columns = None
                if dev.accelerator:
                    with dev.mod.stream(dev.verify_stream):
                        data_work.wait()
                        meta_work.wait()
                        columns = fingerprint_columns_async(buf, nbytes)
                records[t] = _RecvRecord(slot, nbytes, meta_buf, meta_work, data_work, columns)
            if ready is not None:
                r, m = ready
                yield unpack(self.slots.get(r.slot, r.nbytes), m.tensors)
            if kind == DONE:
                manifest = build_manifest(version, [x for i in sorted(tensors) for x in tensors[i]],
                                          [buckets[i] for i in sorted(buckets)])
                if _checksum_words(manifest.checksum) != (csum_a, csum_b):
                    raise DataLoss(f"version {version}: the received buckets do not add up to the sender's manifest")
                log.info("weights_received", transport=self.backend, policy_version=version,
                         total_bytes=manifest.total_bytes, buckets=len(buckets))
                return
            t += 1

