"""Weight sync from every trainer rank (`param_server.collective_sharded`): trainer rank r
broadcasts the rows it owns in a group of its own (`sender_group(group, r)`), every rollout rank
takes part in all of them at once and rebuilds whole tensors (services/weights/shards.py).

    trainer rank 0 ──▶ group rollout.s0 ──┐
    trainer rank 1 ──▶ group rollout.s1 ──┼──▶ every rollout rank: ShardAssembler ─▶ engine
    ...                                   ┘

Each group runs the ordinary protocol of this package (CTRL steps, fingerprints on the device,
NACK and resend, deadlines, the manifest checksum at DONE), so each sender carries 1/S of the
bytes and the S broadcasts share the links: the time per version falls with S until a link or
the receivers' copy-in is the limit. Every sender announces the version (CommitVersion is
idempotent, and each must learn whether the run is stopping); none registers a manifest at the
param server: no single sender holds the whole one, and the bytes never pass through it.

A failed sub-fetch (DataLoss, DeadlineExceeded, ...) cancels the others and fails the version on
this receiver; each group re-forms at the next version as it would alone: every part that failed
or was cancelled reports its generation at its next check-in, so its sender (even one that
finished the version) re-forms with it. A stuck group's process group is released off the event
loop (group.py), so one stalled trainer rank does not freeze the groups of the others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from meshrl.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.common.logging import get_logger

from ...layout import tensor_nbytes
from ...protocols import Bucket
from ...shards import ShardAssembler, sender_group
from .group import WIRE_BUCKET_BYTES
from .receiver import CollectiveFetcher

log = get_logger(__name__)


class ShardedFetcher:
    """A rollout rank receiving from `senders` trainer ranks; yields buckets of whole tensors (new
    memory on this rank's device: valid as long as the caller keeps them)."""

    def __init__(self, backend: str, address: str, *, consumer_id: str, senders: int, group: str = "rollout",
                 timeout_s: float = 300.0, bucket_bytes: int = WIRE_BUCKET_BYTES, delta_sync: bool = False,
                 stall_timeout_s: float | None = None) -> None:
        if senders < 1:
            raise InvalidArgument("trainer.n_gpus_per_node", f"a sharded sync needs >= 1 sender, got {senders}")
        self.parts = [CollectiveFetcher(backend, address, consumer_id=consumer_id, group=sender_group(group, r),
                                        timeout_s=timeout_s, delta_sync=delta_sync, stall_timeout_s=stall_timeout_s)
                      for r in range(senders)]
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.peak_queued_bytes = 0  # the most completed bytes that waited for the consumer
        self.last: dict[str, float] = {}  # the last version received whole: see stats()

    @property
    def transport(self) -> str:
        return self.backend

    @property
    def nacks_sent(self) -> int:
        return sum(p.nacks_sent for p in self.parts)

    async def fetch(self, ref: common_pb2.WeightsRef) -> AsyncIterator[Bucket]:
        assembler = ShardAssembler(self.parts[0].dev.device)
        ready: asyncio.Queue[tuple[Bucket, int] | None] = asyncio.Queue()
        # Completed tensors are new device memory: at most ~2 buckets' worth wait for a slower
        # consumer; a pump over the limit stops pulling from its sender (backpressure).
        limit = 2 * self.bucket_bytes
        queued = 0
        room = asyncio.Condition()

        sending: set[int] = set()  # the parts (trainer ranks) that carried any bytes

        async def pump(part: CollectiveFetcher) -> None:
            nonlocal queued
            async for bucket in part.fetch(ref):
                if bucket:
                    sending.add(id(part))
                done = [x for name, t in bucket for x in assembler.add(name, t)]
                if done:
                    n = sum(tensor_nbytes(t) for _, t in done)
                    async with room:
                        while queued and queued + n > limit:
                            await room.wait()
                        queued += n
                    ready.put_nowait((done, n))

        tasks = [asyncio.create_task(pump(p)) for p in self.parts]
        finished = asyncio.ensure_future(asyncio.gather(*tasks))
        finished.add_done_callback(lambda _: ready.put_nowait(None))
        try:
            while (item := await ready.get()) is not None:
                out: Bucket = list(item[0])
                taken = item[1]
                while not ready.empty() and taken < self.bucket_bytes:  # taken: the bytes of `out`
                    more = ready.get_nowait()
                    if more is None:
                        ready.put_nowait(None)
                        break
                    out.extend(more[0])
                    taken += more[1]
                self.peak_queued_bytes = max(self.peak_queued_bytes, queued)
                yield out
                async with room:  # the consumer asked for more: it is done with these
                    queued -= taken
                    room.notify_all()
            await finished  # a sub-fetch's error surfaces here
            names = assembler.finish()
            self.last = {"weights/sharded_version": float(ref.policy_version), "weights/sharded_senders": float(len(sending)),
                         "weights/sharded_tensors": float(len(names))}
            log.info("weights_assembled", transport=self.backend, policy_version=ref.policy_version,
                     senders=len(self.parts), tensors=len(names))
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(BaseException):
                await finished

    def stats(self) -> dict[str, float]:
        """The last version received whole: its number, how many trainer ranks sent any of it
        (replicas, such as megatron's data-parallel ranks, send nothing) and the tensors rebuilt;
        what the rollout's status reports."""
        return dict(self.last)

    async def close(self) -> None:
        for part in self.parts:
            await part.close()
