"""The collective transport's private process group, its CTRL word layout, and what a member
(sender or receiver) does to join one through the param server's rendezvous."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from meshrl.v1 import param_server_pb2 as pb
from services.common.device import apply_collective_env, import_torch_npu
from services.common.errors import FailedPrecondition, MeshError, Unavailable
from services.common.logging import get_logger
from services.common.net import gloo_address

from ...buffers import ByteBuffers
from ...client import ParamServerClient
from ..base import Deadline
from .device import Device

log = get_logger(__name__)

WIRE_BUCKET_BYTES = 512 << 20  # buckets travel in runs of tensors of at most this (a larger tensor alone)
SEND_SLOTS = 4  # the sender keeps a bucket until every receiver acked it (up to 3 in flight) + 1 to pack
RECV_SLOTS = 3  # the receiver: one being consumed, one on the wire, one posted ahead
RING = 4  # pinned header buffers, by step: one is rewritten only after its copy completed
# CTRL words: this step's kind, bucket index, padded bytes, metadata bytes; the receivers' verdict on
# step t-2 (W_NACK); version; the manifest checksum (DONE, 2 words); the next step's kind and slot
# bytes; the receivers' verdict on step t-1 (W_NACK_NOW: only when step t was announced as no DATA);
# the checksum of this step's bucket metadata (W_META, `meta_checksum`: the fingerprint columns
# cover the bucket's bytes, not the names, shapes and offsets that follow them in the slot); in
# CTRL(0), the sum of the versions the receivers asked for and of their squares (all equal to the
# sender's exactly when both sums are n*v and n*v^2)
CTRL_WORDS = 14
W_NACK, W_NEXT_KIND, W_NEXT_SIZE, W_NACK_NOW, W_META, W_JOIN, W_JOIN_SQ = 4, 8, 9, 10, 11, 12, 13
DATA, FLUSH, DONE, ABORT = 1, 2, 3, 4


def meta_checksum(meta: torch.Tensor) -> torch.Tensor:
    """sum of b_i * (2i + 1) over a bucket's metadata bytes, as an int64[1] on their device (no
    host sync): any changed byte changes it, as does any swap of two unequal bytes. Exact (no
    wrap) below 2^24 bytes of metadata."""
    weights = torch.arange(1, 2 * meta.numel(), 2, dtype=torch.int64, device=meta.device)
    return (meta.to(torch.int64) * weights).sum().reshape(1)


def _make_backend(backend: str, store: Any, rank: int, size: int, timeout: datetime.timedelta,
                  master: str | None = None) -> Any:
    import torch.distributed as dist

    if backend == "gloo":
        address = gloo_address(master) if master else None  # master: the rendezvous store's host
        if address is None:
            return dist.ProcessGroupGloo(store, rank, size, timeout)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # public in torch, unstubbed
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    import_torch_npu()
    apply_collective_env(backend)
    return dist.ProcessGroupHCCL(store, rank, size, timeout)  # type: ignore[attr-defined]


class Group:
    """A private process group: broadcast from rank 0 and sum all-reduce, as async waits. One
    communicator carries both CTRL and DATA: the receiver's host work per bucket, not CTRL queueing
    behind a bucket, is the limit, and a second communicator left the stuck-peer case hanging in
    NCCL's watchdog (BENCHMARKS.md, "Measurement notes moved out of code comments")."""

    def __init__(self, backend: str, store: Any, rank: int, size: int, generation: int, timeout_s: float,
                 dev: Device, master: str | None = None, stall_s: float | None = None) -> None:
        self.backend = backend
        self.stall_s = stall_s
        """A wait on a peer that lasts longer than this fails (`wait`); None: the deadline only."""
        self.rank = rank
        self.size = size
        self.generation = generation
        self.dev = dev
        self.store = store
        if dev.accelerator:
            dev.mod.set_device(dev.device)  # this may run in a worker thread (device is per thread)
        self.pg = _make_backend(backend, store, rank, size, datetime.timedelta(seconds=timeout_s), master)
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
        if self.pg is None:
            raise Unavailable(f"the {self.backend} group (generation {self.generation}) was aborted; it re-forms at the next version")
        with self.dev.comm():
            return self.pg.broadcast([t], opts)

    def allreduce_sum(self, t: torch.Tensor) -> Any:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        if self.pg is None:
            raise Unavailable(f"the {self.backend} group (generation {self.generation}) was aborted; it re-forms at the next version")
        with self.dev.comm():
            return self.pg.allreduce([t], opts)

    async def wait(self, work: Any, deadline: Deadline, doing: str, interrupt: Callable[[], None] | None = None,
                   armed: Callable[[], bool] | None = None) -> None:
        """Poll until `work` completes; a spin on accelerators (µs matter), short sleeps on CPU.
        `interrupt` (called at every poll) may raise to stop waiting. Once `armed()` (default: at
        once), a wait longer than `stall_s` aborts the group: every member is in the broadcast by
        then, so a peer that is not answering is stuck or gone. A backend notices a peer whose
        connection closed, not one that is stopped or hung with its sockets open: that held the
        others until the whole transfer deadline."""
        spins = 0
        since: float | None = None
        while not work.is_completed():
            if interrupt is not None:
                interrupt()
            if deadline.expired():
                self.abort()
                raise deadline.stalled(doing, deadline.timeout_s)
            if self.stall_s is not None and (armed is None or armed()):
                now = time.monotonic()
                since = now if since is None else since
                if now - since > self.stall_s:
                    self.abort()
                    raise deadline.stalled(doing, self.stall_s)
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
        if self.pg is None:  # aborted already
            return
        holder, self.pg = [self.pg], None
        for name in ("abort", "shutdown"):
            fn = getattr(holder[0], name, None)
            if fn is not None:
                with contextlib.suppress(Exception):
                    fn()
                del fn  # a bound method holds the group too
                break
        _release_off_loop(holder)


def _release_off_loop(holder: list[Any]) -> None:
    """Drop the last reference to an aborted process group (the one in `holder`) in a thread of
    its own. Its destructor joins its worker threads, and abort() does not end a collective stuck
    in one (gloo: it waits for the stuck peer, or the group's timeout): run on the event loop (the
    garbage collector happened to free it there), that wait froze every other group of the
    process, e.g. a rollout rank's healthy groups from the other trainer ranks while one trainer
    rank stalled, so their senders missed their deadlines (issue 21)."""

    def release() -> None:
        holder.clear()  # the destructor runs here (pybind releases the GIL for it)
        _releasing.discard(threading.current_thread())

    thread = threading.Thread(target=release, name="meshrl-pg-release", daemon=True)
    _releasing.add(thread)
    thread.start()


_releasing: set[threading.Thread] = set()


def join_releases(timeout_s: float) -> None:
    """Wait (up to `timeout_s`) for the process groups being released: a process that exits while
    a destructor runs in a daemon thread aborts at exit."""
    end = time.monotonic() + timeout_s
    for thread in list(_releasing):
        thread.join(timeout=max(end - time.monotonic(), 0.0))


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def checksum_words(checksum: str) -> tuple[int, int]:
    return _signed(int(checksum[:16], 16)), _signed(int(checksum[16:32], 16))


class GroupMember:
    """What the sender and the receivers share: their device, their place in the group (formed
    through the param server's rendezvous), and whether the next version may start on it at once.

    After a failed version (a deadline, an abort, a peer gone, a cancelled fetch) a member drops
    its group and tells the rendezvous, at its next check-in, the generation it failed in
    (`failed_generation`): the param server retires it, so every member, the sender included, joins
    a new generation (a new process group under a new store prefix) before the next broadcast, and
    nothing of the old one (a stalled rank's late traffic) can reach the new one."""

    def __init__(self, backend: str, address: str, *, group: str, timeout_s: float, member_id: str,
                 slots: int, stall_timeout_s: float | None = None) -> None:
        self.backend = backend
        self.stall_timeout_s = stall_timeout_s  # param_server.stall_timeout_s: Group.wait
        self.dev = Device(backend)
        self.address = address
        self.group_name = group
        self.timeout_s = timeout_s
        self.member_id = member_id
        self.client = ParamServerClient(address)
        self.group: Group | None = None
        self.slots = ByteBuffers(slots, self.dev.device)
        # The group finished the last version: the next one starts on it at once, its rendezvous
        # RPC in the background (_check_in_later); the param server's wait would add ~2 ms.
        self._steady = False
        self._rejoin = False  # a background check-in saw a new generation or failed
        self._checking: asyncio.Task[None] | None = None
        # what the background check-in answered when the generation moved on (the steady group
        # was retired), or its FailedPrecondition (the version is gone): the version stops waiting
        # on the steady group at once (_interrupt)
        self._moved: pb.RendezvousResponse | MeshError | None = None
        self._failed_generation = 0  # the generation this member last failed a version in, until it rejoined

    def _pg_timeout_s(self) -> float:
        return self.timeout_s + 60.0

    async def _build_group(self, store: Any, rank: int, size: int, generation: int, deadline: Deadline) -> Group:
        import torch.distributed as dist

        prefix = dist.PrefixStore(f"meshrl/{self.group_name}/{generation}", store)
        build = asyncio.to_thread(Group, self.backend, prefix, rank, size, generation, self._pg_timeout_s(), self.dev,
                                  store.host, self.stall_timeout_s)
        try:
            return await asyncio.wait_for(build, timeout=max(deadline.remaining(), 0.001))
        except TimeoutError:
            raise deadline.stalled(f"forming the {self.backend} group {self.group_name!r}", deadline.timeout_s) from None

    def drop_group(self, *, failed: bool) -> None:
        """Leave the group. `failed`: a version failed on it; the next check-in reports its
        generation, which the param server then retires (every member re-forms)."""
        self._steady = False
        if self._checking is not None:  # the check-in of a version that failed is moot
            self._checking.cancel()
        if self.group is not None:
            if failed:
                self._failed_generation = self.group.generation
            self.group.abort()
        self.group = None

    def _steady_group(self) -> Group | None:
        """The group to start the next version on without waiting at the rendezvous, if any."""
        self._moved = None
        if self._steady and not self._rejoin and self.group is not None and not self.group.broken:
            return self.group
        self._steady = self._rejoin = False
        return None

    async def _check_in_later(self, request: pb.RendezvousRequest, group: Group) -> None:
        """A steady group's rendezvous for this version, in the background: it keeps the param
        server's board current (who is at which version); a new generation (a member failed the
        last version in this one, or the sender re-formed) stops the version on the steady group at
        once and sends it to the new one, an error there makes the next version wait at the
        rendezvous and re-form the group."""
        try:
            resp = await self.client.rendezvous(request, timeout_s=max(self.timeout_s, 1.0))
            if resp.generation != group.generation:
                self._rejoin = True
                self._moved = resp
        except FailedPrecondition as exc:  # the version is gone: no broadcast will come on any group
            self._rejoin = True
            self._moved = exc
        except (MeshError, OSError) as exc:  # the broadcast checks its peers; this decides the next start
            log.warning("rendezvous_check_in_failed", group=self.group_name, policy_version=request.policy_version,
                        error=str(exc))
            self._rejoin = True

    def _answered(self) -> bool:
        """The version's rendezvous answered (a background check-in's too): every receiver checked
        in for it, after pausing its engine, and posts step 0 at once, so the sender's stall bound
        starts (Group.wait); before, step 0 may wait for a receiver still finishing its requests."""
        return self._checking is None or self._checking.done()

    def _interrupt(self) -> None:
        """Polled while the first step on a steady group waits: raise what the check-in found."""
        moved = self._moved
        if isinstance(moved, MeshError):
            raise moved
        if moved is not None:
            raise GroupMoved(moved)

    async def _moved_after_break(self, started: bool) -> None:
        """Raise GroupMoved if the steady group broke before CTRL(0) went through (not `started`)
        and the version's background check-in answers a new generation (waits for it; its own
        timeout bounds it)."""
        task = self._checking
        if started or task is None:
            return
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)  # it never raises
        self._interrupt()

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
        self.drop_group(failed=False)
        await self._checked_in()
        await self.client.close()
        await asyncio.to_thread(join_releases, 10.0)


class GroupMoved(Exception):
    """The steady group's generation was retired before the version's first step went through on
    it: the version goes to the new generation (`response`: the rendezvous answer)."""

    def __init__(self, response: pb.RendezvousResponse) -> None:
        super().__init__(f"generation {response.generation}")
        self.response = response
