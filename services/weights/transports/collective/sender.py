"""The collective transport's sender: trainer rank 0 broadcasts a version to its group (the
protocol: this package's docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.v1 import common_pb2
from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import DataLoss, FailedPrecondition, InvalidArgument, MeshError, Unavailable
from services.common.logging import get_logger
from services.common.retry import retry_transient

from ... import convert
from ...delta import DeltaEncoder
from ...layout import (
    FINGERPRINT_COLUMNS,
    BucketMeta,
    Manifest,
    TensorMeta,
    build_manifest,
    digest_columns,
    fingerprint_columns_async,
    pack_into,
    round_up,
)
from ...protocols import Buckets, drain
from ..base import Deadline, ManifestBuilder, PlannedBucket, plan_buckets, split_buckets
from .group import (
    ABORT,
    CTRL_WORDS,
    DATA,
    DONE,
    FLUSH,
    RING,
    SEND_SLOTS,
    W_META,
    W_NACK,
    W_NACK_NOW,
    WIRE_BUCKET_BYTES,
    Group,
    GroupMember,
    GroupMoved,
    checksum_words,
    meta_checksum,
)

log = get_logger(__name__)

PARAM_SERVER_AWAY = "the param server is being replaced (param_server.transfer_timeout_s bounds the wait)"


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
    meta_sum: int = 0  # meta_checksum of the metadata (CTRL's W_META word)
    attempts: int = 1


@dataclass
class _Step:
    t: int
    kind: int
    rec: _SendRecord | None
    words: list[int]  # CTRL's header as sent
    ctrl: torch.Tensor  # keeps the device tensor alive until read
    work: Any
    header: torch.Tensor  # CTRL's header words, in host memory once `read` fired
    read: Any
    nxt: _Next
    manifest: Manifest | None = None


@dataclass
class _Next:
    """What step t+1 will send, decided when step t is posted, so that CTRL(t) tells the receivers
    the size of DATA(t+1) and they post its receive while DATA(t) is on the wire: a bucket (`rec`:
    packed right after step t was posted, or NACKed and sent again) or nothing (a control step)."""

    rec: _SendRecord | None = None
    resend: bool = False
    planned: PlannedBucket | None = None  # a new bucket, until packed into `slot`
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


class CollectivePublisher(GroupMember):
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
        stall_timeout_s: float | None = None,
        announce: Callable[[common_pb2.WeightsRef], Awaitable[bool | None]] | None = None,
        member_id: str = "",
        corrupt_hook: Callable[[int, torch.Tensor], None] | None = None,
        wire_bucket_bytes: int = WIRE_BUCKET_BYTES,
        register: bool = True,
        delta_sync: bool = False,
        delta_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(backend, address, group=group, timeout_s=timeout_s,
                         member_id=member_id or f"sender-{uuid.uuid4().hex[:8]}", slots=SEND_SLOTS,
                         stall_timeout_s=stall_timeout_s)
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
        self.register = register  # False: one of several senders of a version (sharded.py), none holds the manifest
        self.delta = DeltaEncoder(self.dev.device, delta_dtype) if delta_sync else None  # services/weights/delta.py
        self._agreed_base = 0  # the rendezvous' answer: the version every receiver holds whole

    @property
    def transport(self) -> str:
        return self.backend

    async def _ensure_group(self, version: int, deadline: Deadline) -> Group:
        import torch.distributed as dist

        if self.group is not None and self.group.broken:
            self.drop_group(failed=True)
        if self._store is None:  # a failed version replaced it: no late traffic reaches the new one
            self._store = await asyncio.to_thread(
                dist.TCPStore, self.master_address, 0, self.receivers + 1, True,
                datetime.timedelta(seconds=self._pg_timeout_s()), False,
            )
        req = self._rendezvous_request(version)
        # A param server being replaced (Serve restarts it) is waited for within the version's
        # deadline; its receivers' fetches fail meanwhile and are retried by their workers.
        resp = await retry_transient(
            f"Rendezvous for version {version}",
            lambda: self.client.rendezvous(req, timeout_s=max(deadline.check("rendezvous"), 0.001)),
            wait_s=deadline.remaining(), hint=PARAM_SERVER_AWAY,
        )
        self._failed_generation = 0  # reported
        self._agreed_base = resp.delta_base_version
        if self.group is None or self.group.generation != resp.generation:
            self.drop_group(failed=False)  # a member failed the last version in it (retired), or a first join
            self.group = await self._build_group(self._store, 0, resp.world_size, resp.generation, deadline)
        return self.group

    def _rendezvous_request(self, version: int) -> pb.RendezvousRequest:
        return pb.RendezvousRequest(
            group=self.group_name, role="sender", member_id=self.member_id, world_size=self.receivers + 1,
            master_address=self.master_address, master_port=self._store.port, backend=self.backend,
            policy_version=version, failed_generation=self._failed_generation,
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
        announced = common_pb2.WeightsRef(policy_version=version, param_server_address=self.address)
        if self.announce is not None and await self.announce(announced) is False:
            drained = await drain(buckets)  # the export runs to its end on every rank
            log.warning("broadcast_skipped", transport=self.backend, policy_version=version, buckets=drained,
                        reason="the run is stopping: no rollout will load this version")
            return announced
        # after the announce, which waits out a coordinator being replaced
        deadline = Deadline(self.timeout_s, f"{self.backend} broadcast of version {version} (group {self.group_name!r})")
        # Once a version went through, the next starts on the same group at once, like the
        # receivers', its rendezvous in the background: if that answers a new generation (a
        # receiver failed the last version after the sender finished it, and dropped its group)
        # before CTRL(0) went through, step 0 goes out again in the new one (_SendSession). Delta
        # sync waits for the answer: it names the base the first bucket is encoded against.
        steady = self._steady_group() if self.delta is None else None
        group: asyncio.Future[Group]
        if steady is not None:
            self._checking = asyncio.create_task(self._check_in_later(self._rendezvous_request(version), steady))
            group = asyncio.get_running_loop().create_future()
            group.set_result(steady)
        else:
            group = asyncio.ensure_future(self._ensure_group(version, deadline))
        if self.delta is not None:
            async def agreed_base() -> int:
                await asyncio.shield(group)
                return self._agreed_base

            buckets = self.delta.encode(version, buckets, agreed_base)
        try:
            planned = plan_buckets(split_buckets(buckets, self.wire_bucket_bytes)).__aiter__()
            manifest = await _SendSession(self, group, version, planned, deadline).run()
        except BaseException as exc:
            if self.announce is not None and isinstance(exc, MeshError):
                # announce made the version current (CommitVersion): the trainer may go on from it
                # (TrainerLoop._broadcast_failed); the attribute survives pickling (Ray)
                exc.announced_version = version  # type: ignore[attr-defined]
            group.cancel()
            with contextlib.suppress(BaseException):
                await group
            self.drop_group(failed=True)
            self._store = None
            if self.delta is not None:
                self.delta.reset()
            raise
        self._steady = True
        if self.delta is not None:
            self.delta.commit(version)
            log.info("weights_delta_sent", transport=self.backend, **self.delta.last.as_dict())
        if self.dev.accelerator:  # every broadcast is done: the trainer's next steps may use the
            self.slots.release()  # slots' memory (the caching allocator hands it back at the next publish)
        if self.register:
            # Registering the same manifest again is a no-op, so a param server being replaced is
            # waited for (in the background; the next publish settles it) instead of failing the
            # next version with a lost registration.
            self._registering = asyncio.create_task(retry_transient(
                f"registering version {version}'s manifest",
                lambda: self.client.register(manifest, timeout_s=max(self.timeout_s, 1.0)),
                wait_s=self.timeout_s, hint=PARAM_SERVER_AWAY,
            ))
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

    def _pack(self, slot: int, planned: PlannedBucket, meta: bytes) -> _SendRecord:
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
                           self.dev.pinned_copy(columns, ("columns", slot)), self.dev.record(),
                           int(meta_checksum(torch.frombuffer(bytearray(meta), dtype=torch.uint8))[0]) if meta else 0)

    def _meta_bytes(self, version: int, planned: PlannedBucket) -> bytes:
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


class SendAgainProbe:
    """Whether the version a sender sent last must go again (the param server's
    RendezvousBoard.wanted_again, asked with role "probe"): every receiver of each of `groups`
    (rank 0's group, or every trainer rank's with param_server.collective_sharded) waits for it
    in a generation the sender has not joined. Called by the trainer loop while it has no groups
    to train on (TrainerLoop._send_again_if_wanted), from the trainer's process: it checks in to
    nothing."""

    def __init__(self, address: str, groups: list[str], *, security: Any = None, timeout_s: float = 10.0) -> None:
        from ...client import ParamServerClient

        self.groups = groups
        self.timeout_s = timeout_s
        self.client = ParamServerClient(address, security=security)

    async def __call__(self, version: int) -> bool:
        for group in self.groups:
            resp = await self.client.rendezvous(pb.RendezvousRequest(group=group, role="probe", policy_version=version),
                                                timeout_s=self.timeout_s)
            if not resp.wanted_again:
                return False
        return True

    async def close(self) -> None:
        await self.client.close()


class _SendSession:
    """One version's broadcast, as the sender sees it. Step t's CTRL and bytes are posted together,
    one step ahead of the host: the host reads CTRL(t) (done once DATA(t-1) is off the wire) while
    DATA(t) is on it, then posts step t+1 (announced in CTRL(t), packed while DATA(t) was on the
    wire), deciding step t+2 (announced in CTRL(t+1)) and packing it. A bucket keeps its slot
    until every receiver acked it; a NACKed one is sent again from its slot."""

    def __init__(self, pub: CollectivePublisher, group_ready: asyncio.Future[Group], version: int,
                 planned: AsyncIterator[PlannedBucket], deadline: Deadline) -> None:
        self.pub = pub
        self.dev = pub.dev
        self.group_ready = group_ready
        self.version = version
        self.planned = planned
        self.deadline = deadline
        self.builder = ManifestBuilder(version)
        self.held: dict[int, _SendRecord | None] = {}  # slot -> its bucket until acked (None: reserved for the next)
        self.resend: list[_SendRecord] = []  # NACKed, to send again
        self.failed: list[_SendRecord] = []  # NACKed max_attempts times: the next control step is ABORT
        self.verdicts: dict[tuple[int, int], _SendRecord] = {}  # (step, CTRL word) -> the bucket whose verdict it carries
        self.works: dict[int, Any] = {}  # slot -> its last broadcast
        self.exhausted = False  # every bucket was planned
        self.pending: list[_SendRecord] = []  # first sends (in bucket order) whose fingerprints the manifest lacks
        self.group: Group | None = None  # once the rendezvous is done (the first step is packed before)
        self.manifest: Manifest | None = None  # built once the last fingerprint is in (before DONE)

    async def run(self) -> Manifest:
        await asyncio.sleep(0)  # the rendezvous RPC starts before the first bucket is gathered and packed
        first = await self._decide()
        await self._pack(first)
        step = await self._first_step(await self._post(0, first))
        assert self.group is not None
        group, deadline, version = self.group, self.deadline, self.version
        while True:
            t = step.t
            await group.wait(step.work, deadline, f"step {t} control exchange")
            due = [(w, self.verdicts.pop((t, w))) for w in (W_NACK, W_NACK_NOW) if (t, w) in self.verdicts]
            if due:
                await group.wait_event(step.read, deadline, f"step {t} control exchange")
            for w, rec in due:
                if not int(step.header[w]):
                    del self.held[rec.slot]  # every receiver has it: the slot is free
                elif rec.attempts >= self.pub.max_attempts:
                    self.failed.append(rec)
                else:
                    self.resend.append(rec)
            if step.kind == ABORT:
                bad = self.failed[0]
                raise DataLoss(f"version {version}: bucket {bad.index} failed its checksum on a receiver "
                               f"{bad.attempts} times (param_server.max_fetch_attempts={self.pub.max_attempts})")
            if step.kind == DONE:
                for w in self.works.values():
                    await group.wait(w, deadline, "finishing the broadcast")
                assert step.manifest is not None
                return step.manifest
            step = await self._post(t + 1, step.nxt)

    async def _first_step(self, step: _Step) -> _Step:
        """Wait for CTRL(0) and check that every receiver asked for this version. On a steady group
        the background check-in may retire the group meanwhile: the version then goes to the new
        generation, step 0 posted again there (nothing went through the old one; every receiver
        starts the version over in the new one). After a rendezvous there is no such check-in."""
        pub = self.pub
        while True:
            assert self.group is not None
            try:
                try:
                    await self.group.wait(step.work, self.deadline, "step 0 control exchange", pub._interrupt,
                                          armed=pub._answered)
                    await self.group.wait_event(step.read, self.deadline, "step 0 control exchange")
                    pub._check_join(step.header.tolist(), pub.receivers, self.version)
                    return step
                except (Unavailable, FailedPrecondition):
                    # a receiver left the old group for the new one first (gloo), or asked for
                    # another version: one behind gives its version up and checks in for this one,
                    # which retires the group (the check-in answers the new generation); one ahead
                    # makes the check-in fail at once (it skipped this version)
                    await pub._moved_after_break(started=False)
                    raise
            except GroupMoved as moved:
                log.info("rendezvous_group_moved", group=pub.group_name, policy_version=self.version, role="sender",
                         generation=moved.response.generation)
                pub.drop_group(failed=False)
                pub._moved = None
                self.group = pub.group = await pub._build_group(pub._store, 0, moved.response.world_size,
                                                                moved.response.generation, self.deadline)
                self.works.clear()  # the old group's broadcasts ended with its abort
                step = self._repost(step)

    def _repost(self, step: _Step) -> _Step:
        """Post step 0 again, unchanged, in a new group (its CTRL rebuilt: the aborted all-reduce
        may have written into the old one)."""
        assert self.group is not None
        rec = step.rec
        ctrl = self.pub._ctrl(step.t, step.words, rec.columns if rec is not None else None)
        self.dev.after_default()
        work = self.group.allreduce_sum(ctrl)
        header, read = self.dev.read_later(ctrl[:CTRL_WORDS], work, ("header_in", step.t % RING))
        if rec is not None:
            self.works[rec.slot] = self.group.broadcast(self.pub.slots.get(rec.slot, rec.padded + rec.meta_len))
        return dataclasses.replace(step, ctrl=ctrl, work=work, header=header, read=read)

    async def _digest_ready(self, wait: bool) -> None:
        """Add the fingerprints that reached host memory (all of them with `wait`) to the manifest."""
        pending = self.pending
        while pending and (wait or pending[0].columns_ready is None or pending[0].columns_ready.query()):
            r = pending.pop(0)
            assert self.group is not None  # it was sent: a group exists
            await self.group.wait_event(r.columns_ready, self.deadline, "fingerprinting a bucket")
            self.builder.add(PlannedBucket(r.index, [], r.metas, r.nbytes), digest_columns(r.columns_host, r.nbytes))

    async def _decide(self) -> _Next:
        """The step after the one being posted: a resend first, else the next bucket if a slot
        is free, else a control step."""
        if self.failed:
            return _Next()
        if self.resend:
            return _Next(rec=self.resend.pop(0), resend=True)
        free = [s for s in range(SEND_SLOTS) if s not in self.held]
        if self.exhausted or not free:
            return _Next()
        planned = await anext(self.planned, None)
        if planned is None:
            self.exhausted = True
            return _Next()
        self.held[free[0]] = None
        return _Next(planned=planned, slot=free[0], meta=self.pub._meta_bytes(self.version, planned))

    async def _pack(self, nxt: _Next) -> None:
        if nxt.planned is None:
            return
        if nxt.slot in self.works:  # the slot's last send must be off the wire (it was acked: it is)
            assert self.group is not None
            await self.group.wait(self.works.pop(nxt.slot), self.deadline, "sending a bucket")
        if any(r.slot == nxt.slot for r in self.pending):  # its host copy of the columns is reused
            await self._digest_ready(wait=True)
        self.builder.note(nxt.planned)  # the tensors are gone by the time the manifest is built
        nxt.rec = self.held[nxt.slot] = self.pub._pack(nxt.slot, nxt.planned, nxt.meta)
        nxt.planned = None

    def _kind(self, rec: _SendRecord | None) -> int:
        if rec is not None:
            return DATA
        if self.failed:
            return ABORT
        if self.exhausted and not self.held and not self.resend:
            return DONE
        return FLUSH

    async def _post(self, t: int, cur: _Next) -> _Step:
        dev, version = self.dev, self.version
        nxt = await self._decide()
        rec = cur.rec
        if cur.resend:
            assert rec is not None
            rec.attempts += 1
            self.pub.resent_buckets += 1
            log.warning("bucket_nacked_resending", policy_version=version, bucket=rec.index, attempt=rec.attempts)
        kind = self._kind(rec)
        header = [kind, rec.index if rec else 0, rec.padded if rec else 0, rec.meta_len if rec else 0,
                  0, version, 0, 0, DATA if nxt.data else 0, nxt.size()] + [0] * (CTRL_WORDS - 10)
        if rec is not None:
            header[W_META] = rec.meta_sum
        manifest = None
        if kind == DONE:
            if self.manifest is None:
                await self._digest_ready(wait=True)
                self.manifest = self.builder.build([self.pub.backend])
            manifest = self.manifest
            header[6], header[7] = checksum_words(manifest.checksum)
        ctrl = self.pub._ctrl(t, header, rec.columns if rec is not None else None)
        if self.group is None:  # the first step was packed while the rendezvous ran
            self.group = await self.group_ready
        group = self.group
        dev.after_default()
        work = group.allreduce_sum(ctrl)
        step = _Step(t, kind, rec, header, ctrl, work, *dev.read_later(ctrl[:CTRL_WORDS], work, ("header_in", t % RING)),
                     nxt, manifest)
        if rec is not None:
            self.works[rec.slot] = group.broadcast(self.pub.slots.get(rec.slot, rec.padded + rec.meta_len))
            if rec.attempts == 1:
                self.pending.append(rec)
            # the receivers report on a bucket two steps later, or at once when no DATA follows
            self.verdicts[(t + 2, W_NACK) if nxt.data else (t + 1, W_NACK_NOW)] = rec
        await self._pack(nxt)  # while DATA(t) is on the wire
        await self._digest_ready(wait=False)
        if self.exhausted and not self.pending and self.manifest is None:  # while the last steps are on the wire
            self.manifest = self.builder.build([self.pub.backend])
        return step
