"""The `disk` transport with a real param server over gRPC on loopback: the param server decides
whether a version number may be published again (a resumed trainer's orphan) before any file
changes, a refused version leaves no directory behind, and a fetcher reads only the files of the
manifest the param server handed it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.common.config.param_server import ParamServerConfig
from services.common.errors import DataLoss, FailedPrecondition
from services.param_server.server import ParamServerServer
from services.weights.transports.disk import DiskFetcher, DiskPublisher, bucket_file, read_manifest, version_dir


def buckets(seed: int) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [[("model.embed_tokens.weight", torch.randn(64, 32, generator=g).bfloat16()),
             ("model.norm.weight", torch.randn(32, generator=g))],
            [("lm_head.weight", torch.randn(100, 32, generator=g))]]


async def fetch_all(fetcher: DiskFetcher, ref: object) -> dict[str, torch.Tensor]:
    return {name: t.clone() async for bucket in fetcher.fetch(ref) for name, t in bucket}  # type: ignore[arg-type]


def same(got: dict[str, torch.Tensor], seed: int) -> bool:
    want = {n: t for b in buckets(seed) for n, t in b}
    return set(got) == set(want) and all(torch.equal(got[n], t) for n, t in want.items())


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=120))  # type: ignore[arg-type]


def test_a_resumed_trainer_replaces_its_unseen_orphan_and_never_a_version_a_consumer_read(tmp_path: Path) -> None:
    async def main() -> None:
        server = ParamServerServer(ParamServerConfig(port=0, disk_dir=str(tmp_path)))
        await server.start()
        crashed = DiskPublisher(tmp_path, address=server.address)
        resumed = DiskPublisher(tmp_path, address=server.address)
        fetcher = DiskFetcher(tmp_path, consumer_id="rollout-0")
        try:
            await crashed.publish(1, buckets(1))
            ref1 = await crashed.publish(2, buckets(2))
            assert same(await fetch_all(fetcher, ref1), 2)  # version 2 was seen
            await crashed.publish(3, buckets(3))  # ... and the trainer died before committing 3
            # Resumed from the checkpoint of step 2: version 3 again, other weights (the orphan goes).
            ref3 = await resumed.publish(3, buckets(33))
            assert read_manifest(version_dir(tmp_path, 3)).checksum == ref3.manifest_checksum
            assert same(await fetch_all(fetcher, ref3), 33)
            # A version a consumer read is never replaced: refused, its files untouched.
            before = (version_dir(tmp_path, 2) / "manifest.pb").read_bytes()
            with pytest.raises(FailedPrecondition, match="consumers have seen it"):
                await resumed.publish(2, buckets(22))
            assert (version_dir(tmp_path, 2) / "manifest.pb").read_bytes() == before
            assert same(await fetch_all(fetcher, ref1), 2)
            # The same content again (a retried publish) is a no-op.
            assert (await resumed.publish(3, buckets(33))).manifest_checksum == ref3.manifest_checksum
            # nothing left over (retention already deleted version 1)
            assert entries(tmp_path) == ["v000000000002", "v000000000003"]
        finally:
            await fetcher.close()
            await crashed.close()
            await resumed.close()
            await server.stop()

    run(main())


def test_a_refused_version_leaves_no_directory_and_a_fetcher_checks_the_files_against_its_manifest(tmp_path: Path) -> None:
    async def main() -> None:
        server = ParamServerServer(ParamServerConfig(port=0, disk_dir=str(tmp_path / "shared")))
        await server.start()
        pub = DiskPublisher(tmp_path / "shared", address=server.address)
        other = DiskPublisher(tmp_path / "elsewhere", address=server.address)  # a disk_dir that differs
        fetcher = DiskFetcher(tmp_path / "shared", consumer_id="rollout-0")
        try:
            ref = await pub.publish(1, buckets(1))
            assert same(await fetch_all(fetcher, ref), 1)
            # Refused by the param server (version 1 was read with other content): no directory stays
            # behind in `elsewhere`, which no eviction would ever delete.
            with pytest.raises(FailedPrecondition):
                await other.publish(1, buckets(11))
            assert entries(tmp_path / "elsewhere") == []
            # Version 2 registered from `elsewhere` (nobody read `shared`'s version 2 yet: an orphan to the
            # param server): a fetcher on `shared` holds other files than the manifest it acquired.
            await pub.publish(2, buckets(2))
            ref2 = await other.publish(2, buckets(22))
            with pytest.raises(DataLoss, match="param server holds"):
                await fetch_all(fetcher, ref2)
        finally:
            await fetcher.close()
            await pub.close()
            await other.close()
            await server.stop()

    run(main())


@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_a_torn_header_is_read_again_then_data_loss(tmp_path: Path, damage: str) -> None:
    """A torn read on a network filesystem hits the safetensors header as well as the data: it
    escaped the first read as a bare struct.error / UnicodeDecodeError (no re-read, an error type
    the callers do not handle). It is read again, then DataLoss, as damaged data is."""
    async def main() -> None:
        pub = DiskPublisher(tmp_path)
        ref = await pub.publish(1, buckets(1))
        path = bucket_file(version_dir(tmp_path, 1), 1)
        data = bytearray(path.read_bytes())
        data = data[:4] if damage == "truncated" else data[:8] + b"\x00" * 8 + data[16:]  # zeros where the JSON starts
        path.write_bytes(bytes(data))
        fetcher = DiskFetcher(tmp_path, consumer_id="r0", max_attempts=2)
        with pytest.raises(DataLoss, match="unreadable safetensors header"):
            await fetch_all(fetcher, ref)
        assert fetcher.reread_buckets == 2
        await fetcher.close()
        await pub.close()

    run(main())
