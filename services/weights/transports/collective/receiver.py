"""The collective transport's receiver: a rollout rank takes part in its group's broadcasts (the
protocol: this package's docstring)."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshrl.v1 import common_pb2
from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import DataLoss, DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from services.common.logging import get_logger

from ... import convert
from ...delta import DeltaDecoder
from ...layout import (
    FINGERPRINT_COLUMNS,
    BucketMeta,
    TensorMeta,
    build_manifest,
    digest_columns,
    fingerprint_columns_async,
    round_up,
    unpack,
)
from ...protocols import Bucket
from ..base import Deadline
from .group import (
    ABORT,
    CTRL_WORDS,
    DATA,
    DONE,
    RECV_SLOTS,
    RING,
    W_JOIN,
    W_JOIN_SQ,
    W_META,
    W_NACK,
    W_NACK_NOW,
    Group,
    GroupMember,
    GroupMoved,
    checksum_words,
    meta_checksum,
)

log = get_logger(__name__)


@dataclass
class _RecvRecord:
    t: int
    index: int
    slot: int
    nbytes: int
    meta_len: int  # the metadata follows the bucket's bytes in the slot
    expected: torch.Tensor  # the sender's fingerprint columns: CTRL(t)'s tail, on the device
    expected_meta: torch.Tensor  # the sender's meta_checksum: CTRL(t)'s W_META word, on the device
    data_work: Any
    bad: torch.Tensor | None = None  # int64[1] on the device: 1 if the columns differ from `expected`
    meta_host: torch.Tensor | None = None
    columns_host: torch.Tensor | None = None
    bad_host: torch.Tensor | None = None
    landed: Any = None  # event: the bucket arrived, was checked, and its columns reached host memory


def bucket_verdict(buf: torch.Tensor, nbytes: int, meta_len: int, expected: torch.Tensor,
                   expected_meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fingerprint columns of a received slot's `nbytes`, int64[1] 1 if they or its metadata
    differ from the sender's), enqueued on the current stream. The metadata counts too: it names
    where each tensor's bytes go and is parsed before the version's checksum (at DONE) could
    notice. Zero padding up to `nbytes` gives the same columns."""
    columns = fingerprint_columns_async(buf, nbytes)
    meta_bad = meta_checksum(buf[nbytes : nbytes + meta_len]) != expected_meta
    return columns, ((columns != expected).any() | meta_bad[0]).to(torch.int64).reshape(1)


def _never() -> bool:
    return False


class CollectiveFetcher(GroupMember):
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
        stall_timeout_s: float | None = None,
        corrupt_hook: Callable[[int, int, torch.Tensor], None] | None = None,
        delta_sync: bool = False,
    ) -> None:
        if not consumer_id:
            raise InvalidArgument("consumer_id", "required (a stable id of this rank)")
        super().__init__(backend, address, group=group, timeout_s=timeout_s, member_id=consumer_id, slots=RECV_SLOTS,
                         stall_timeout_s=stall_timeout_s)
        self._corrupt_hook = corrupt_hook  # tests: damage received bytes (step, bucket, buffer)
        self.nacks_sent = 0
        self._started = False  # CTRL(0) of the version went through
        self.delta = DeltaDecoder() if delta_sync else None  # services/weights/delta.py

    @property
    def transport(self) -> str:
        return self.backend

    def _rendezvous_request(self, version: int) -> pb.RendezvousRequest:
        return pb.RendezvousRequest(group=self.group_name, role="receiver", member_id=self.member_id,
                                    backend=self.backend, policy_version=version,
                                    failed_generation=self._failed_generation,
                                    delta_base_version=self.delta.version if self.delta is not None else 0)

    async def _ensure_group(self, version: int, deadline: Deadline) -> Group:
        req = self._rendezvous_request(version)
        try:
            resp = await self.client.rendezvous(req, timeout_s=max(deadline.check("rendezvous"), 0.001))
        except DeadlineExceeded as exc:  # the sender never came to this version
            raise deadline.stalled(f"waiting at the param server's rendezvous for the sender of version {version}",
                                   deadline.timeout_s) from exc
        return await self._join(resp, deadline)

    async def _join(self, resp: pb.RendezvousResponse, deadline: Deadline) -> Group:
        """The group the rendezvous answered: the one held if it is that generation, else a new one."""
        import torch.distributed as dist

        self._failed_generation = 0  # reported: the answer is a generation every member joins anew
        if self.group is not None and (self.group.broken or self.group.generation != resp.generation):
            self.drop_group(failed=self.group.broken)
        if self.group is None:
            store = await asyncio.to_thread(
                dist.TCPStore, resp.master_address, resp.master_port, resp.world_size, False,
                datetime.timedelta(seconds=max(deadline.remaining(), 1.0)),
            )
            try:
                self.group = await self._build_group(store, resp.rank, resp.world_size, resp.generation, deadline)
            except BaseException:
                self._failed_generation = resp.generation  # half-formed there: never join it again
                raise
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
        delta = self.delta
        if delta is not None:
            delta.begin(version)
        try:
            while True:
                self._started = False
                try:
                    try:
                        async for bucket in self._receive(group, version, deadline):
                            yield delta.decode(bucket) if delta is not None else bucket
                        break
                    except Unavailable:
                        # the steady group broke before its first step went through (the sender
                        # dropped it: it re-forms in a new generation): the check-in answers that one
                        await self._moved_after_break(self._started)
                        raise
                except GroupMoved as moved:  # nothing went through the steady group: go to the new one
                    log.info("rendezvous_group_moved", group=self.group_name, policy_version=version,
                             generation=moved.response.generation)
                    self.drop_group(failed=False)
                    self._moved = None
                    group = await self._join(moved.response, deadline)
            if delta is not None:
                delta.commit()
                log.info("weights_delta_received", transport=self.backend, **delta.last.as_dict())
            done = True
            self._steady = True
        finally:
            if not done:
                self.drop_group(failed=True)  # a broken-off receive leaves the group out of step: re-form it
                if delta is not None:
                    delta.reset()

    def _post_ctrl(self, group: Group, t: int, nack: _RecvRecord | None,
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

    async def _land(self, group: Group, rec: _RecvRecord, deadline: Deadline) -> None:
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
                rec.expected_meta.record_stream(dev.verify_stream)
            columns, rec.bad = bucket_verdict(buf, rec.nbytes, rec.meta_len, rec.expected, rec.expected_meta)
            rec.columns_host = dev.pinned_copy(columns, ("columns", rec.slot))
            rec.bad_host = dev.pinned_copy(rec.bad, ("bad", rec.slot))
            rec.meta_host = dev.pinned_copy(buf[rec.nbytes : rec.nbytes + rec.meta_len], ("meta", rec.slot))
            rec.landed = dev.record()

    async def _verify(self, group: Group, rec: _RecvRecord, deadline: Deadline) -> tuple[bool, pb.Manifest]:
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

    async def _receive(self, group: Group, version: int, deadline: Deadline) -> AsyncIterator[Bucket]:
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
            # until CTRL(0) went through, a steady group's check-in may retire it (_interrupt)
            # step 0 waits for the sender's first bucket, which may wait for a training step its
            # export is queued behind: no stall bound there, the deadline only
            await group.wait(work, deadline, f"step {t} control exchange", self._interrupt if t == 0 else None,
                             armed=_never if t == 0 else None)
            self._started = True
            await group.wait_event(read, deadline, f"step {t} control exchange")
            words = header.tolist()
            kind, index, nbytes, meta_len, _, sender_version, csum_a, csum_b, next_kind, next_size = words[:10]
            try:
                if sender_version != version:
                    raise FailedPrecondition(f"the group is broadcasting version {sender_version}, expected {version}")
                if t == 0:
                    self._check_join(words, group.size - 1, version)
            except FailedPrecondition:
                if t == 0 and sender_version <= version:
                    # the sender or another receiver is behind: it fails its version and comes to
                    # this one in a new generation, which the check-in still waiting at the param
                    # server answers (one ahead makes it fail: the version is gone). Giving the
                    # version up here would leave that check-in to answer the sender's rendezvous
                    # for a group this receiver never joins.
                    await self._moved_after_break(started=False)
                raise
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
                rec = unreported[t] = _RecvRecord(t, index, slot, nbytes, meta_len, ctrl[CTRL_WORDS:],
                                                  ctrl[W_META : W_META + 1], posted[0])
            report = [unreported.pop(t - 1, None), None]  # the verdicts CTRL(t+1) carries
            if rec is not None and next_kind != DATA:
                await self._land(group, rec, deadline)
                report[1] = unreported.pop(t)
            if kind == DONE:
                if unreported or report[0] is not None:
                    raise DataLoss(f"version {version}: the sender finished before this receiver reported on "
                                   f"steps {sorted(unreported) or [t - 1]} (the peers disagree on the protocol)")
                got = manifest()
                if checksum_words(got.checksum) != (csum_a, csum_b):
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
