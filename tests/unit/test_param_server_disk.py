"""The `disk` transport on a real directory (no param server): safetensors files any reader
loads, atomic versions, corruption detected, cold start from the newest version."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshrl.v1 import common_pb2
from services.common.errors import DataLoss, NotFound
from services.weights.transports.disk import DiskFetcher, DiskPublisher, bucket_file, version_dir


def buckets(seed: int) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [("model.layers.0.mlp.up_proj.weight", torch.randn(64, 32, generator=g).bfloat16()),
         ("model.layers.0.input_layernorm.weight", torch.randn(32, generator=g)),
         ("mask", torch.rand(7, generator=g) > 0.5)],
        [("lm_head.weight", torch.randn(100, 32, generator=g))],
    ]


async def fetch_all(fetcher: DiskFetcher, ref: common_pb2.WeightsRef) -> dict[str, torch.Tensor]:
    out = {}
    async for bucket in fetcher.fetch(ref):
        for name, t in bucket:
            out[name] = t.clone()
    return out


def test_disk_round_trip_is_bit_exact_and_files_are_plain_safetensors(tmp_path: Path) -> None:
    async def main() -> None:
        pub = DiskPublisher(tmp_path)
        fetcher = DiskFetcher(tmp_path, consumer_id="r0")
        ref = await pub.publish(7, buckets(7))
        got = await fetch_all(fetcher, ref)
        want = {n: t for b in buckets(7) for n, t in b}
        assert set(got) == set(want)
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        loaded = load_file(str(bucket_file(version_dir(tmp_path, 7), 0)))
        assert torch.equal(loaded["model.layers.0.mlp.up_proj.weight"], want["model.layers.0.mlp.up_proj.weight"])
        assert [p.name for p in tmp_path.iterdir()] == ["v000000000007"]  # no temporary left behind
        # cold start: a negative version means the newest on disk
        await pub.publish(9, buckets(9))
        newest = await fetch_all(fetcher, common_pb2.WeightsRef(policy_version=-1))
        assert torch.equal(newest["lm_head.weight"], buckets(9)[1][0][1])
        await pub.close()
        await fetcher.close()

    asyncio.run(main())


def test_a_corrupted_file_is_read_again_then_reported(tmp_path: Path) -> None:
    async def main() -> None:
        pub = DiskPublisher(tmp_path)
        ref = await pub.publish(1, buckets(1))
        path = bucket_file(version_dir(tmp_path, 1), 1)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x01
        path.write_bytes(bytes(data))
        fetcher = DiskFetcher(tmp_path, consumer_id="r0", max_attempts=2)
        with pytest.raises(DataLoss, match="fails its checksum after 2 reads"):
            await fetch_all(fetcher, ref)
        assert fetcher.reread_buckets == 2
        data[-5] ^= 0x01
        path.write_bytes(bytes(data))
        assert torch.equal((await fetch_all(fetcher, ref))["lm_head.weight"], buckets(1)[1][0][1])
        with pytest.raises(NotFound, match="shared directory"):
            await fetch_all(fetcher, common_pb2.WeightsRef(policy_version=2))
        await fetcher.close()

    asyncio.run(main())


def test_packed_buckets_are_written_with_their_packers_fingerprints(tmp_path: Path) -> None:
    """A bucket the export packed (packing.py) is written without a fingerprint pass of its own;
    the reader checks the file against the packer's fingerprint, so a buffer written after it was
    taken is caught there."""
    from services.weights.layout import fingerprint_bytes
    from services.weights.packing import pack_bucket

    async def main() -> None:
        pub = DiskPublisher(tmp_path)
        packed = [pack_bucket(b) for b in buckets(3)]
        ref = await pub.publish(3, packed)
        fetcher = DiskFetcher(tmp_path, consumer_id="r0", max_attempts=1)
        got = await fetch_all(fetcher, ref)
        assert all(torch.equal(got[n], t) for b in buckets(3) for n, t in b)
        assert packed[0].fingerprint == fingerprint_bytes(packed[0].buffer.numpy())
        spoiled = [pack_bucket(b) for b in buckets(4)]
        spoiled[1].buffer[3] ^= 0xFF
        with pytest.raises(DataLoss, match="fails its checksum"):
            await fetch_all(fetcher, await pub.publish(4, spoiled))
        await pub.close()
        await fetcher.close()

    asyncio.run(main())
