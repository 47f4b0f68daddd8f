"""RayTrainGroup over fake rank handles: whose results come back (one rank per data-parallel
share, whatever the engine's rank order), and an export that one rank fails while rank 0 waits
for it in a collective."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from services.trainer.engines.base import SequenceBatch


class _Remote:
    def __init__(self, call: Any) -> None:
        self._call = call

    def remote(self, *args: Any) -> Any:
        return asyncio.ensure_future(self._call(*args))


class _LogprobRank:
    """compute_logprobs answers each sequence's first token id as its logprob (what every rank of
    a data-parallel share computes: megatron broadcasts the last stage's result over PP)."""

    def __init__(self) -> None:
        async def compute_logprobs(batch: SequenceBatch, *_: Any) -> tuple[torch.Tensor, None]:
            return batch.input_ids.float()[:, :1].expand(-1, batch.input_ids.shape[1]).contiguous(), None

        self.compute_logprobs = _Remote(compute_logprobs)


def _batch(n: int, length: int = 4) -> SequenceBatch:
    ids = (torch.arange(n) + 1).unsqueeze(1).expand(n, length).contiguous()
    ones = torch.ones(n, length, dtype=torch.long)
    return SequenceBatch(ids, ones, ones.float())


def _megatron_layout(tp: int, pp: int, dp: int) -> list[dict[str, int]]:
    """megatron's default rank order, tp-cp-ep-dp-pp (tp fastest): dp_rank = (r // tp) % dp."""
    return [{"dp_rank": (r // tp) % dp, "dp_size": dp} for r in range(tp * pp * dp)]


@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 2, 2), (2, 2, 2), (2, 1, 2), (1, 1, 4)])
def test_logprobs_come_back_for_every_data_parallel_share(tp: int, pp: int, dp: int) -> None:
    from services.trainer.workers import RayTrainGroup

    layout = _megatron_layout(tp, pp, dp)
    group = RayTrainGroup([_LogprobRank() for _ in layout], "pg", layout, 0)
    batch = _batch(8)
    logprobs, _ = asyncio.run(group.compute_logprobs(batch, temperature=1.0))
    # with PP > 1 the ranks r % (tp*pp) == 0 are all of dp_rank 0: the other shares' rows stayed 0
    assert torch.equal(logprobs, batch.input_ids.float()), logprobs[:, 0]


class _Stream:
    """A rank's export stream (an ObjectRefGenerator): refs as an async iterator."""

    def __init__(self, items: Any) -> None:
        self._items = items

    def __aiter__(self) -> Any:
        return self._items


def test_a_rank_that_fails_its_export_fails_the_export_while_rank_0_waits_for_it() -> None:
    """Rank 1's export fails (its actor died, its load raised): rank 0 waits in the all-gather
    for it until the collective timeout. The export must fail now, not after rank 0's stream."""
    from services.trainer.workers import RayTrainGroup

    async def rank0() -> Any:
        await asyncio.Event().wait()  # in an all-gather with rank 1, which never comes
        yield None

    async def rank1() -> Any:
        raise RuntimeError("rank 1 died in its export")
        yield None

    async def scenario() -> None:
        group = RayTrainGroup([object(), object()], "pg", [{"dp_rank": 0, "dp_size": 1}] * 2, 0)
        export = group._drain_export([_Stream(rank0()), _Stream(rank1())])
        with pytest.raises(RuntimeError, match="rank 1 died"):
            await asyncio.wait_for(export.__anext__(), timeout=5.0)

    asyncio.run(scenario())
