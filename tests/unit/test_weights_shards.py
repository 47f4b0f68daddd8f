"""Shard wire names and the receiver's reassembly (services/weights/shards.py)."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import DataLoss
from services.weights.shards import Shard, ShardAssembler, parse_shard, sender_group, shard_name


def test_names_round_trip_and_plain_names_are_not_shards() -> None:
    wire = shard_name("model.layers.0.mlp.down_proj.weight", 32, 64, 100)
    assert parse_shard(wire) == ("model.layers.0.mlp.down_proj.weight", 32, 64, 100, 0)
    cols = shard_name("model.layers.0.mlp.down_proj.weight", 0, 16, 64, dim=1)
    assert cols == "model.layers.0.mlp.down_proj.weight@cols=0:16/64"
    assert parse_shard(cols) == Shard("model.layers.0.mlp.down_proj.weight", 0, 16, 64, dim=1)
    assert parse_shard("model.norm.weight") is None
    with pytest.raises(ValueError, match=r"dim 0 .* or 1"):
        shard_name("w", 0, 1, 2, dim=2)
    assert sender_group("rollout", 3) == "rollout.s3"
    with pytest.raises(ValueError, match="non-empty"):
        shard_name("w", 5, 5, 10)


def test_shards_in_any_order_rebuild_the_tensor_and_plain_tensors_pass_through() -> None:
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    asm = ShardAssembler("cpu")
    assert asm.add(shard_name("w", 4, 7, 7), full[4:]) == []
    src = full[:4].clone()
    [(name, got)] = asm.add(shard_name("w", 0, 4, 7), src)
    src.zero_()  # the caller's buffer is reused: the assembler copied it
    assert name == "w" and torch.equal(got, full)
    flag = torch.tensor(True)
    [(fname, fgot)] = asm.add("flag", flag)
    assert fname == "flag" and fgot.item() is True and fgot.data_ptr() != flag.data_ptr()
    assert asm.finish() == ["flag", "w"]


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ((shard_name("w", 2, 6, 8), torch.zeros(4, 3)), "overlap"),
        ((shard_name("w", 0, 3, 3, dim=1), torch.zeros(8, 3)), "disagree"),
        ((shard_name("w", 4, 8, 8), torch.zeros(4, 2)), "disagree"),
        ((shard_name("w", 4, 8, 8), torch.zeros(4, 3, dtype=torch.bfloat16)), "disagree"),
        ((shard_name("w", 4, 8, 9), torch.zeros(4, 3)), "disagree"),
        ((shard_name("w", 4, 8, 8), torch.zeros(3, 3)), "not 4 rows"),
        (("w", torch.zeros(8, 3)), "again"),
    ],
)
def test_inconsistent_shards_are_data_loss(second: tuple[str, torch.Tensor], message: str) -> None:
    asm = ShardAssembler("cpu")
    asm.add(shard_name("w", 0, 4, 8), torch.zeros(4, 3))
    with pytest.raises(DataLoss, match=message):
        asm.add(*second)


def test_column_shards_rebuild_the_tensor_and_must_agree_on_the_rows() -> None:
    """megatron's row-parallel weights (o_proj, down_proj) are split along dim 1."""
    full = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    asm = ShardAssembler("cpu")
    assert asm.add(shard_name("w", 3, 6, 6, dim=1), full[:, 3:]) == []
    [(name, got)] = asm.add(shard_name("w", 0, 3, 6, dim=1), full[:, :3].clone())
    assert name == "w" and torch.equal(got, full)
    bad = ShardAssembler("cpu")
    bad.add(shard_name("w", 0, 3, 6, dim=1), torch.zeros(4, 3))
    with pytest.raises(DataLoss, match="disagree"):
        bad.add(shard_name("w", 3, 6, 6, dim=1), torch.zeros(5, 3))
    with pytest.raises(DataLoss, match="not 3 cols"):
        bad.add(shard_name("w", 3, 6, 6, dim=1), torch.zeros(4))
    with pytest.raises(DataLoss, match=r"incomplete.*3/6 cols"):
        bad.finish()


def test_missing_rows_fail_at_the_end_and_a_shard_after_completion_is_data_loss() -> None:
    asm = ShardAssembler("cpu")
    asm.add(shard_name("w", 0, 4, 8), torch.zeros(4, 3))
    with pytest.raises(DataLoss, match="incomplete"):
        asm.finish()
    done = ShardAssembler("cpu")
    done.add(shard_name("w", 0, 1, 1), torch.zeros(1, 3))
    with pytest.raises(DataLoss, match="sent twice"):
        done.add(shard_name("w", 0, 1, 1), torch.zeros(1, 3))


def test_a_slow_consumer_holds_back_the_sharded_fetch_at_two_buckets() -> None:
    """Completed tensors are new device memory: with a consumer slower than the senders (vLLM's
    load) they must not pile up to a whole model beside the engine's weights. Two parts of 20
    buckets of 1 MiB each, a consumer that sleeps after each bucket: at most ~2 buckets wait, and
    every tensor arrives once."""
    import asyncio
    import types

    from meshrl.v1 import common_pb2
    from services.weights.transports.collective.sharded import ShardedFetcher

    mib = 1 << 20

    class Part:
        dev = types.SimpleNamespace(device="cpu")

        def __init__(self, rank: int) -> None:
            self.rank = rank
            self.pulled = 0

        async def fetch(self, ref: common_pb2.WeightsRef):
            for i in range(20):
                self.pulled += 1
                yield [(f"r{self.rank}.t{i}", torch.full((mib // 4,), float(i), dtype=torch.float32))]

    fetcher = ShardedFetcher("gloo", "127.0.0.1:1", consumer_id="c", senders=2, bucket_bytes=mib)
    fetcher.parts = [Part(0), Part(1)]  # type: ignore[list-item]

    ahead: list[int] = []  # buckets pulled from the senders beyond those the consumer took

    async def main() -> list[str]:
        got: list[str] = []
        async for bucket in fetcher.fetch(common_pb2.WeightsRef(policy_version=1)):
            got += [name for name, _ in bucket]
            await asyncio.sleep(0.01)
            ahead.append(sum(p.pulled for p in fetcher.parts) - len(got))  # type: ignore[attr-defined]
        return got

    got = asyncio.run(main())
    assert sorted(got) == sorted(f"r{r}.t{i}" for r in (0, 1) for i in range(20))
    # two queued and one in each pump's hand at most (it was all 40 after the first bucket)
    assert max(ahead) <= 4, ahead
    assert fetcher.peak_queued_bytes <= 2 * mib
    # what the rollout's status reports of it: both trainer ranks sent, 40 tensors rebuilt
    assert fetcher.stats() == {"weights/sharded_version": 1.0, "weights/sharded_senders": 2.0,
                               "weights/sharded_tensors": 40.0}


def test_a_sender_with_nothing_to_send_is_not_counted_among_the_senders() -> None:
    """A megatron data-parallel replica takes part in the version but sends no bytes."""
    import asyncio
    import types

    from meshrl.v1 import common_pb2
    from services.weights.shards import shard_name
    from services.weights.transports.collective.sharded import ShardedFetcher

    class Part:
        dev = types.SimpleNamespace(device="cpu")

        def __init__(self, rows: tuple[int, int] | None) -> None:
            self.rows = rows

        async def fetch(self, ref: common_pb2.WeightsRef):
            if self.rows is not None:
                a, b = self.rows
                yield [(shard_name("w", a, b, 4), torch.ones(b - a, 2))]

    fetcher = ShardedFetcher("gloo", "127.0.0.1:1", consumer_id="c", senders=3)
    fetcher.parts = [Part((0, 2)), Part((2, 4)), Part(None)]  # type: ignore[list-item]

    async def main() -> list[tuple[str, torch.Tensor]]:
        return [x async for bucket in fetcher.fetch(common_pb2.WeightsRef(policy_version=7)) for x in bucket]

    [(name, t)] = asyncio.run(main())
    assert name == "w" and torch.equal(t, torch.ones(4, 2))
    assert fetcher.stats() == {"weights/sharded_version": 7.0, "weights/sharded_senders": 2.0,
                               "weights/sharded_tensors": 1.0}
