"""`RayTrainGroup`, the TrainGroup that drives a training group's ranks: Ray actors
(`ranks.TrainWorker`, asked for by `ranks.spawn`) in one placement group.

    RayTrainGroup.create(spec, world_size, device)
      placement group: world_size bundles of {CPU: worker_num_cpus, GPU|NPU: 1}, PACK
      rank actors start; rank 0 picks MASTER_ADDR:MASTER_PORT; every rank builds its engine
    every collective call goes to all ranks at once; each DP rank gets its share of the batch,
    the ranks of one Ulysses group the same share; results come back from SP rank 0 of each group.

Weights leave through rank 0 as a Ray streaming generator (bucket by bucket) while the other ranks
run the same export to take part in the all-gathers. With a collective transport (nccl / hccl /
gloo) rank 0 is the sender itself (`start_sender`, `publish_weights`): the broadcast needs the
rank's device, and the weights do not cross to the trainer's Serve replica at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import remove_placement_group

from meshrl.v1 import common_pb2
from services.common.errors import root_cause
from services.common.logging import get_logger
from services.weights import Bucket, WeightPublisher
from services.weights.packing import from_wire

from .engines.base import EngineSpec, LossFn, SequenceBatch, StepResult
from .group import scatter_rows, shards

log = get_logger(__name__)

class RankSender:
    """Rank 0's weight publisher on an event loop of its own (a thread of the rank actor), so a
    broadcast goes on while the rank trains. `publish` is called from the rank's call thread with
    the export's iterator: it starts the publish, hands the buckets over as the export makes them
    (host copies, so training may change the weights right after) and returns once the export is
    done; `result` blocks until that version's publish finished."""

    def __init__(self, make: Callable[[], WeightPublisher]) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rank0-weights", daemon=True)
        self._thread.start()

        async def build() -> WeightPublisher:  # on its loop: the publisher's gRPC channels live there
            return make()

        self.publisher = asyncio.run_coroutine_threadsafe(build(), self.loop).result()
        self._lock = threading.Lock()
        self._results: dict[int, concurrent.futures.Future[common_pb2.WeightsRef]] = {}

    def _future(self, version: int, *, fresh: bool = False) -> concurrent.futures.Future[common_pb2.WeightsRef]:
        """The outcome of `version`'s publish. `fresh` (a publish starting): a finished entry is an
        earlier attempt's (the loop sends a version again after a failed broadcast), not this one's."""
        with self._lock:
            current = self._results.get(version)
            if current is None or (fresh and current.done()):
                current = self._results[version] = concurrent.futures.Future()
            return current

    def publish(self, version: int, buckets: Iterator[Bucket]) -> None:
        queue: asyncio.Queue[Bucket | BaseException | None] = asyncio.Queue()

        async def stream() -> AsyncIterator[Bucket]:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):  # the export failed: never publish part of a version
                    raise item
                yield item

        done = self._future(version, fresh=True)
        running = asyncio.run_coroutine_threadsafe(self.publisher.publish(version, stream()), self.loop)

        def settle(f: concurrent.futures.Future[common_pb2.WeightsRef]) -> None:
            # a publish that ended cancelled (grpc.aio, a channel closed under its call) fails the
            # version: f.exception() would raise in this callback, and result() wait for ever
            if f.cancelled():
                done.set_exception(RuntimeError(f"the publish of version {version} was cancelled"))
            elif (e := f.exception()) is not None:
                done.set_exception(e)
            else:
                done.set_result(f.result())

        running.add_done_callback(settle)
        end: BaseException | None = None
        try:
            for bucket in buckets:
                self.loop.call_soon_threadsafe(queue.put_nowait, bucket)
        except BaseException as exc:
            end = exc
            raise
        finally:
            self.loop.call_soon_threadsafe(queue.put_nowait, end)

    def result(self, version: int) -> common_pb2.WeightsRef:
        done = self._future(version)
        try:
            return done.result()
        finally:  # failed or not: a later attempt at this version gets an entry of its own
            with self._lock:
                if self._results.get(version) is done:
                    del self._results[version]

    def close(self, timeout_s: float = 30.0) -> None:
        close = getattr(self.publisher, "close", None)
        try:
            if close is not None:
                asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout_s)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)


async def _next_or_none(stream: Any) -> Any:
    """The stream's next item; None at its end."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _unless_one_fails(step: asyncio.Future[Any], watched: Sequence[asyncio.Future[Any]]) -> None:
    """Wait for `step`; if a `watched` task fails first, cancel `step` and raise that failure."""
    while True:
        for task in watched:
            if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
                step.cancel()
                raise exc
        if step.done():
            return
        await asyncio.wait([step, *(t for t in watched if not t.done())], return_when=asyncio.FIRST_COMPLETED)


class RayTrainGroup:
    """TrainGroup over rank actors (see the module docstring). Use `await RayTrainGroup.create(...)`."""

    def __init__(self, workers: list[Any], pg: Any, layout: list[dict[str, int]], step: int, *,
                 rank0_node: str = "") -> None:
        self.workers = workers
        # rank 0's exported buckets lie in this node's object store when it runs on this node: the
        # object_store publisher then registers them as they are (packing.PackedBucket.stored)
        self._rank0_here = bool(rank0_node) and rank0_node == ray.get_runtime_context().get_node_id()
        self.pg = pg
        self.layout = layout
        self._step = step
        self._senders: list[Any] = workers[:1]
        self.dp_size = layout[0]["dp_size"]
        self.sp_size = len(workers) // self.dp_size
        # one rank per data-parallel share answers for it: the first rank that has it (SP rank 0 of
        # an FSDP group, rank = dp * sp + sp; not r % sp == 0, which in megatron's order, tp-cp-ep-dp-pp,
        # picks ranks of dp rank 0 only once PP > 1)
        first: dict[int, int] = {}
        for r, lay in enumerate(layout):
            first.setdefault(lay["dp_rank"], r)
        self._leaders = sorted(first.values())

    @classmethod
    async def create(
        cls, spec: EngineSpec, world_size: int, *, backend: str, num_cpus: float = 1.0, timeout_s: float = 600.0,
        nice: int | None = None, resources: dict[str, float] | None = None,
    ) -> RayTrainGroup:
        from .ranks import spawn

        return await spawn(spec.device, world_size, num_cpus=num_cpus, resources=resources).start(
            spec, backend, nice=nice, timeout_s=timeout_s)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def step(self) -> int:
        return self._step

    def _shares(self, batch: SequenceBatch) -> tuple[list[list[int]], list[SequenceBatch]]:
        index = shards(batch, self.dp_size)
        parts = [batch.select(index[self.layout[r]["dp_rank"]]) for r in range(self.world_size)]
        return index, parts

    async def compute_logprobs(
        self, batch: SequenceBatch, *, temperature: float, reference: bool = False, proximal: bool = False,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        index, parts = self._shares(batch)
        outs = await asyncio.gather(*[
            w.compute_logprobs.remote(p, temperature, reference, proximal, with_entropy)
            for w, p in zip(self.workers, parts, strict=True)
        ])
        shape = (batch.num_seqs, int(batch.input_ids.shape[1]))
        leaders = self._leaders
        logprobs = scatter_rows([(index[self.layout[r]["dp_rank"]], outs[r][0]) for r in leaders], shape)
        entropy = None
        if with_entropy:
            entropy = scatter_rows([(index[self.layout[r]["dp_rank"]], outs[r][1]) for r in leaders], shape)
        return logprobs, entropy

    async def train(self, batch: SequenceBatch, loss_fn: LossFn, *, temperature: float) -> StepResult:
        _, parts = self._shares(batch)
        results = await asyncio.gather(*[
            w.train.remote(p, loss_fn, temperature) for w, p in zip(self.workers, parts, strict=True)
        ])
        self._step = results[0].step
        return results[0]  # type: ignore[no-any-return]

    async def snapshot_proximal(self) -> None:
        await asyncio.gather(*[w.snapshot_proximal.remote() for w in self.workers])

    def export_weights(self, bucket_bytes: int) -> AsyncIterator[Bucket]:
        # Submitted now: a rank runs its calls in order, so a train call made after this one
        # returns cannot change the weights being exported.
        streams = [w.export_weights.options(num_returns="streaming").remote(bucket_bytes) for w in self.workers]
        return self._drain_export(streams)

    async def _drain_export(self, streams: list[Any]) -> AsyncIterator[Bucket]:
        async def drain(stream: Any) -> None:
            async for ref in stream:
                await ref

        others = [asyncio.ensure_future(drain(s)) for s in streams[1:]]
        first = streams[0].__aiter__()
        step: asyncio.Future[Any] | None = None
        try:
            while True:
                # another rank's failure ends the export now: rank 0 may be waiting for that rank
                # in a collective, which would only time out (actor_rollout_ref nccl_timeout)
                step = asyncio.ensure_future(_next_or_none(first))
                await _unless_one_fails(step, others)
                ref = step.result()
                if ref is None:
                    break
                # the stream's objects are owned by this process (the caller of the generator)
                yield from_wire(await ref, stored=ref if self._rank0_here else None)
            await asyncio.gather(*others)
        finally:
            for task in [*others, *([step] if step is not None else [])]:
                if not task.done():
                    task.cancel()

    async def start_sender(
        self, make: Callable[[], WeightPublisher], every_rank: Callable[[int], WeightPublisher] | None = None
    ) -> None:
        if every_rank is None:
            await self.workers[0].start_sender.remote(make)
            self._senders = self.workers[:1]
            return
        await asyncio.gather(*[w.start_sender.remote(functools.partial(every_rank, r), True)
                               for r, w in enumerate(self.workers)])
        self._senders = list(self.workers)

    def publish_weights(self, version: int, bucket_bytes: int) -> Awaitable[common_pb2.WeightsRef]:
        # Submitted now, as export_weights: the export is ordered before any later call.
        exports = [w.publish_weights.remote(version, bucket_bytes) for w in self.workers]
        results = [w.published.remote(version) for w in self._senders]

        async def published() -> common_pb2.WeightsRef:
            await asyncio.gather(*exports)
            # a version is out once every sender is done, failed or not: the first error alone
            # would let the next version start while another rank still sends this one
            outcomes = await asyncio.gather(*results, return_exceptions=True)
            errors = [o for o in outcomes if isinstance(o, BaseException)]
            if errors:
                # one the loop cannot take in its stride first (an announced broadcast failure it can)
                raise next((e for e in errors if getattr(root_cause(e), "announced_version", None) is None), errors[0])
            return common_pb2.WeightsRef.FromString(outcomes[0])  # type: ignore[arg-type]

        return published()

    async def save_checkpoint(self, path: Path) -> None:
        await asyncio.gather(*[w.save_checkpoint.remote(str(path)) for w in self.workers])

    async def load_checkpoint(self, path: Path) -> None:
        await asyncio.gather(*[w.load_checkpoint.remote(str(path)) for w in self.workers])
        self._step = await self.workers[0].step.remote()

    async def save_hf(self, path: Path) -> None:
        await asyncio.gather(*[w.save_hf.remote(str(path)) for w in self.workers])

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort: the actors are killed next anyway
            await asyncio.wait_for(asyncio.gather(*[w.stop_sender.remote() for w in self._senders]), timeout=30.0)
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)
