"""The ranks of a training group as Ray actors in one placement group, and `RayTrainGroup`, the
TrainGroup that drives them.

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
import collections
import concurrent.futures
import contextlib
import functools
import os
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from meshrl.v1 import common_pb2
from services.common.device import ray_resource
from services.common.logging import configure_logging, get_logger
from services.common.priority import set_niceness
from services.common.startup import StartupClock
from services.weights import Bucket, WeightPublisher

from .engines.base import EngineSpec, LossFn, SequenceBatch, StepResult, TrainEngine, get_engine_cls
from .engines.batching import micro_batches_for
from .group import scatter_rows, shards

log = get_logger(__name__)

WEIGHTS_GROUP = "weights"  # the rank actor's concurrency group for waiting on a broadcast


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

    def _future(self, version: int) -> concurrent.futures.Future[common_pb2.WeightsRef]:
        with self._lock:
            return self._results.setdefault(version, concurrent.futures.Future())

    def publish(self, version: int, buckets: Iterator[Bucket]) -> None:
        queue: asyncio.Queue[Bucket | BaseException | None] = asyncio.Queue()

        async def stream() -> AsyncIterator[Bucket]:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):  # the export failed: never publish part of a version
                    raise item
                yield item

        done = self._future(version)
        running = asyncio.run_coroutine_threadsafe(self.publisher.publish(version, stream()), self.loop)
        running.add_done_callback(lambda f: done.set_exception(e) if (e := f.exception()) else done.set_result(f.result()))
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
        ref = self._future(version).result()
        with self._lock:
            self._results.pop(version, None)
        return ref

    def close(self, timeout_s: float = 30.0) -> None:
        close = getattr(self.publisher, "close", None)
        try:
            if close is not None:
                asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout_s)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)


class TrainWorker:
    """One rank. Built lightweight; `init_engine` joins the process group and builds the engine."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.engine: TrainEngine | None = None
        self.spec: EngineSpec | None = None
        self.sender: RankSender | None = None
        self.own_shards = False
        self._clock = StartupClock(f"trainer_rank{rank}")

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port (asked of rank 0 for MASTER_ADDR/PORT)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def init_engine(
        self, spec: EngineSpec, backend: str, master_addr: str, master_port: int, nice: int | None = None
    ) -> dict[str, int]:
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
        )
        configure_logging("trainer", rank=self.rank)
        set_niceness(nice, key="tuning.nice.trainer_ranks")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.spec = spec
        self._clock.mark("init_engine")
        self.engine = get_engine_cls(backend, spec.device).build(spec)
        self._clock.mark("engine_built")
        return {"dp_rank": self.engine.dp_rank, "dp_size": self.engine.dp_size}

    def _engine(self) -> TrainEngine:
        assert self.engine is not None, "init_engine was not called"
        return self.engine

    def compute_logprobs(
        self, batch: SequenceBatch, temperature: float, reference: bool, proximal: bool, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        engine = self._engine()
        if proximal:
            out = engine.compute_proximal_logprobs(batch, temperature=temperature)
        else:
            out = engine.compute_logprobs(batch, temperature=temperature, with_entropy=with_entropy, reference=reference)
        return out.logprobs, out.entropy

    def train(self, batch: SequenceBatch, loss_fn: LossFn, temperature: float) -> StepResult:
        assert self.spec is not None
        return self._engine().train_step(micro_batches_for(self.spec.actor, batch), loss_fn, temperature=temperature)

    def snapshot_proximal(self) -> None:
        self._engine().snapshot_proximal()

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        yield from self._engine().export_weights(bucket_bytes)

    def start_sender(self, make: Callable[[], WeightPublisher], own_shards: bool = False) -> None:
        """Become a weight sender (`make` builds the publisher, e.g. the collective one): rank 0
        of the whole weights, or with `own_shards` any rank of the rows it owns."""
        assert own_shards or self.rank == 0, "only rank 0 sends the whole weights"
        self.sender = RankSender(make)
        self.own_shards = own_shards

    def publish_weights(self, version: int, bucket_bytes: int) -> None:
        """Every rank exports (the all-gathers); rank 0 hands the buckets to its sender (with
        `own_shards`, every rank exports and sends its own rows, no all-gather). Returns once the
        export is done: the broadcast goes on while later calls run."""
        engine = self._engine()
        buckets = engine.export_shards(bucket_bytes) if self.own_shards else engine.export_weights(bucket_bytes)
        if self.sender is None:  # the all-gathers only: run the export to its end, keep nothing
            collections.deque(buckets, maxlen=0)
            return
        self.sender.publish(version, buckets)

    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def published(self, version: int) -> bytes:
        """A sender: blocks until version's publish finished; its WeightsRef, serialized."""
        assert self.sender is not None, "start_sender was not called"
        return self.sender.result(version).SerializeToString()

    def save_checkpoint(self, path: str) -> None:
        self._engine().save_checkpoint(Path(path))

    def load_checkpoint(self, path: str) -> None:
        self._engine().load_checkpoint(Path(path))

    def save_hf(self, path: str) -> None:
        self._engine().save_hf(Path(path))

    def step(self) -> int:
        return self._engine().step

    def stop_sender(self) -> None:
        """Rank 0: settle and close the sender (its last manifest registration)."""
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class SpawnedRanks:
    """Rank actors asked of Ray (`RayTrainGroup.spawn`), their engines not built yet."""

    def __init__(self, group_cls: type[RayTrainGroup], workers: list[Any], pg: Any) -> None:
        self.group_cls = group_cls
        self.workers = workers
        self.pg = pg

    async def start(self, spec: EngineSpec, backend: str, *, nice: int | None = None,
                    timeout_s: float = 600.0) -> RayTrainGroup:
        """Join the process group and build every rank's engine; on any failure (cancellation
        included) the actors and their placement group are gone."""
        workers = self.workers
        try:
            await asyncio.wait_for(self.pg.ready(), timeout=timeout_s)
            addr, port = await workers[0].address.remote()
            layout = await asyncio.wait_for(
                asyncio.gather(*[w.init_engine.remote(spec, backend, addr, port, nice) for w in workers]), timeout=timeout_s
            )
            step = await workers[0].step.remote()
        except BaseException:
            self.kill()
            raise
        log.info("train_group_ready", world_size=len(workers), dp=layout[0]["dp_size"], device=spec.device)
        return self.group_cls(workers, self.pg, list(layout), step)

    def kill(self) -> None:
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)


class RayTrainGroup:
    """TrainGroup over rank actors (see the module docstring). Use `await RayTrainGroup.create(...)`."""

    def __init__(self, workers: list[Any], pg: Any, layout: list[dict[str, int]], step: int) -> None:
        self.workers = workers
        self.pg = pg
        self.layout = layout
        self._step = step
        self._senders: list[Any] = workers[:1]
        self.dp_size = layout[0]["dp_size"]
        self.sp_size = len(workers) // self.dp_size

    @classmethod
    async def create(
        cls, spec: EngineSpec, world_size: int, *, backend: str, num_cpus: float = 1.0, timeout_s: float = 600.0,
        nice: int | None = None, resources: dict[str, float] | None = None,
    ) -> RayTrainGroup:
        return await cls.spawn(spec, world_size, num_cpus=num_cpus, resources=resources).start(
            spec, backend, nice=nice, timeout_s=timeout_s)

    @classmethod
    def spawn(cls, spec: EngineSpec, world_size: int, *, num_cpus: float = 1.0,
              resources: dict[str, float] | None = None) -> SpawnedRanks:
        """Ask Ray for the rank actors now (their placement group, their processes and imports go
        on in the background); `SpawnedRanks.start` builds the engines."""
        resource = ray_resource(spec.device)
        bundle: dict[str, float] = {"CPU": num_cpus} if num_cpus > 0 else {}
        bundle.update(resources or {})  # custom resources: which nodes may hold a rank
        if resource is not None:
            bundle[resource] = 1.0
        pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        options: dict[str, Any] = {"num_cpus": num_cpus}
        custom = dict(resources or {})
        if resource == "GPU":
            options["num_gpus"] = 1
        elif resource is not None:
            custom[resource] = 1
        if custom:
            options["resources"] = custom
        actor_cls: Any = ray.remote(concurrency_groups={WEIGHTS_GROUP: 1})(TrainWorker)  # type: ignore[call-overload]
        workers: list[Any] = [
            actor_cls.options(
                **options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=r),
            ).remote(r, world_size)
            for r in range(world_size)
        ]
        return SpawnedRanks(cls, workers, pg)

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
        leaders = [r for r in range(self.world_size) if r % self.sp_size == 0]
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
        try:
            async for ref in streams[0]:
                yield await ref
            await asyncio.gather(*others)
        finally:
            for task in others:
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
            refs = await asyncio.gather(*results)  # a version is out once every sender is done
            return common_pb2.WeightsRef.FromString(refs[0])

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
