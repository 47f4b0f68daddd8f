"""A training group as the loop sees it: whole batches in, whole results out.

The group splits a batch over its data-parallel ranks (balanced by tokens; the ranks of one
Ulysses group get the same share), has every rank run the collective call, and puts per-token
results back in batch order. `LocalTrainGroup` is one in-process engine (tests, one-rank runs);
`services.trainer.workers.RayTrainGroup` drives rank actors in a placement group.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Protocol

import torch

from meshrl.v1 import common_pb2
from services.common.config.actor_rollout_ref import ActorConfig
from services.weights import Bucket, WeightPublisher

from .engines.base import LossFn, SequenceBatch, StepResult, TrainEngine
from .engines.batching import micro_batches_for, shard_for_dp


class TrainGroup(Protocol):
    """What the trainer loop drives. Calls are made one at a time."""

    @property
    def world_size(self) -> int: ...

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        ...

    async def compute_logprobs(
        self, batch: SequenceBatch, *, temperature: float, reference: bool = False, proximal: bool = False,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, L] logprobs (and entropy) under the current / reference / proximal policy."""
        ...

    async def train(self, batch: SequenceBatch, loss_fn: LossFn, *, temperature: float) -> StepResult:
        """One optimizer step on the mini-batch `batch`."""
        ...

    async def snapshot_proximal(self) -> None: ...

    def export_weights(self, bucket_bytes: int) -> AsyncIterator[Bucket]:
        """The weights as they are at this call: the export is ordered before any group call made
        after it returns, so training may go on while the buckets are consumed."""
        ...

    async def start_sender(
        self, make: Callable[[], WeightPublisher], every_rank: Callable[[int], WeightPublisher] | None = None
    ) -> None:
        """Build the publisher `make` returns where rank 0 runs, or `every_rank(r)` on every rank r
        (see RankZeroPublisher)."""
        ...

    def publish_weights(self, version: int, bucket_bytes: int) -> Awaitable[common_pb2.WeightsRef]:
        """Publish the weights as they are at this call through rank 0's sender, or every rank's
        (ordered as export_weights is); the awaitable gives rank 0's ref once every sender is done."""
        ...

    async def save_checkpoint(self, path: Path) -> None: ...

    async def load_checkpoint(self, path: Path) -> None: ...

    async def save_hf(self, path: Path) -> None: ...

    async def close(self) -> None: ...


def shards(batch: SequenceBatch, dp_size: int) -> list[list[int]]:
    """Sequence indices per data-parallel rank."""
    return shard_for_dp(batch, dp_size)


def scatter_rows(parts: list[tuple[list[int], torch.Tensor]], shape: tuple[int, int]) -> torch.Tensor:
    """Per-rank [b_r, l_r] results -> [B, L] in batch order."""
    out = torch.zeros(shape, dtype=torch.float32)
    for index, values in parts:
        if index:
            out[torch.as_tensor(index, dtype=torch.long), : values.shape[1]] = values.float()
    return out


class LocalTrainGroup:
    """One engine in this process (world size 1). Engine calls run in a worker thread so the
    event loop (gRPC status, coordinator calls) stays responsive."""

    def __init__(self, engine: TrainEngine, actor: ActorConfig) -> None:
        self.engine = engine
        self.actor = actor
        self._export: asyncio.Future[list[Bucket]] | None = None
        self._sender: WeightPublisher | None = None

    @property
    def world_size(self) -> int:
        return 1

    @property
    def step(self) -> int:
        return self.engine.step

    async def compute_logprobs(
        self, batch: SequenceBatch, *, temperature: float, reference: bool = False, proximal: bool = False,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        await self._exported()
        if proximal:
            out = await asyncio.to_thread(self.engine.compute_proximal_logprobs, batch, temperature=temperature)
        else:
            out = await asyncio.to_thread(
                self.engine.compute_logprobs, batch, temperature=temperature, with_entropy=with_entropy, reference=reference
            )
        return out.logprobs, out.entropy

    async def train(self, batch: SequenceBatch, loss_fn: LossFn, *, temperature: float) -> StepResult:
        await self._exported()
        micro = micro_batches_for(self.actor, batch)
        return await asyncio.to_thread(self.engine.train_step, micro, loss_fn, temperature=temperature)

    async def snapshot_proximal(self) -> None:
        await self._exported()
        await asyncio.to_thread(self.engine.snapshot_proximal)

    def export_weights(self, bucket_bytes: int) -> AsyncIterator[Bucket]:
        # The whole export is taken now, in a thread, and every later engine call waits for it:
        # host memory for one copy of the weights (this group is for tests and one-rank runs).
        export = asyncio.get_running_loop().run_in_executor(None, lambda: list(self.engine.export_weights(bucket_bytes)))
        self._export = export

        async def buckets() -> AsyncIterator[Bucket]:
            for bucket in await export:
                yield bucket

        return buckets()

    async def start_sender(
        self, make: Callable[[], WeightPublisher], every_rank: Callable[[int], WeightPublisher] | None = None
    ) -> None:
        # one rank owns every row: its shard export is the whole export, sent in rank 0's group
        self._sender = every_rank(0) if every_rank is not None else make()

    def publish_weights(self, version: int, bucket_bytes: int) -> Awaitable[common_pb2.WeightsRef]:
        assert self._sender is not None, "start_sender was not called"
        return self._sender.publish(version, self.export_weights(bucket_bytes))

    async def _exported(self) -> None:
        """Wait for an export in progress (its error is the consumer's to report)."""
        if self._export is not None:
            await asyncio.wait([self._export])
            self._export = None

    async def save_checkpoint(self, path: Path) -> None:
        await self._exported()
        await asyncio.to_thread(self.engine.save_checkpoint, path)

    async def load_checkpoint(self, path: Path) -> None:
        await self._exported()
        await asyncio.to_thread(self.engine.load_checkpoint, path)

    async def save_hf(self, path: Path) -> None:
        await self._exported()
        await asyncio.to_thread(self.engine.save_hf, path)

    async def close(self) -> None:
        close = getattr(self._sender, "close", None)
        if close is not None:
            await close()
        self.engine.close()
