"""The `disk` transport on a real directory (no param server): safetensors files any reader
loads, atomic versions, corruption detected, cold start from the newest version, and an orphan
version's directory removed when its successor replaces it over another transport."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshrl.v1 import common_pb2
from services.common.errors import DataLoss, NotFound
from services.param_server.factory import evict_disk_versions
from services.param_server.store import StoreSettings, WeightStore
from services.weights.transports.disk import DiskFetcher, DiskPublisher, bucket_file, read_manifest, version_dir
from tests.unit.test_param_server_store import make_version, upload


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


def test_an_orphan_disk_version_replaced_over_grpc_leaves_no_directory_behind(tmp_path: Path) -> None:
    """A disk version no consumer saw (the orphan of a trainer that died before its commit) is
    replaced by its successor's publish of the same number over grpc. The store dropped the orphan
    without its eviction hook, and the new version does not name `disk`: the directory stayed
    forever, and a cold DiskFetcher could read the orphan's weights under that number."""
    store = WeightStore(StoreSettings(retain_versions=1), on_evict=evict_disk_versions(tmp_path))

    async def publish() -> None:
        pub = DiskPublisher(tmp_path)  # the files; the registration below is what the server receives
        await pub.publish(1, buckets(1))
        await pub.close()

    asyncio.run(publish())
    store.register(read_manifest(version_dir(tmp_path, 1)), 0.0)
    successor, its_buffers = make_version(1, seed=9)  # resumed from a checkpoint: other weights
    upload(store, successor, its_buffers, 1.0, manifest_first=True)
    assert store.manifest(1).checksum == successor.checksum
    assert not version_dir(tmp_path, 1).exists(), "the orphan's directory outlives its version"
    for v in (2, 3):  # and nothing is left to evict once version 1 falls out of retention
        upload(store, *make_version(v), float(v), manifest_first=True)
    assert [s.policy_version for s in store.versions()] == [3]
