"""A disk fetcher that reads a version directory between the two renames of a replaced orphan's
swap (DiskPublisher._replace) waits for the swap, as documented, instead of failing NotFound."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import torch

from services.weights.transports.disk import DiskFetcher, DiskPublisher, read_manifest, version_dir
from tests.unit.test_param_server_disk import buckets, fetch_all


class _Client:
    def __init__(self, manifest):
        self.manifest = manifest
        self.released = []

    async def acquire(self, consumer_id, policy_version, *, timeout_s=None):
        return self.manifest

    async def release(self, consumer_id, policy_version, *, timeout_s=None):
        self.released.append(policy_version)

    async def close(self):
        """Nothing to close: no channel behind this client."""


def test_a_fetch_between_the_swaps_two_renames_waits_for_the_swap(tmp_path: Path) -> None:
    async def main() -> None:
        root, staging = tmp_path / "shared", tmp_path / "staging"
        await DiskPublisher(root).publish(3, buckets(3))       # the orphan
        ref = await DiskPublisher(staging).publish(3, buckets(33))  # its replacement, accepted by the param server
        final, new = version_dir(root, 3), version_dir(staging, 3)
        ref.param_server_address = "ps:1"
        client = _Client(read_manifest(new))
        fetcher = DiskFetcher(root, consumer_id="r0")
        fetcher._clients["ps:1"] = client  # type: ignore[assignment]
        os.rename(final, root / ".v000000000003.replaced")  # the swap's first rename

        async def second_rename() -> None:
            await asyncio.sleep(0.3)
            os.rename(new, final)

        task = asyncio.create_task(second_rename())
        got = await fetch_all(fetcher, ref)
        await task
        want = {n: t for b in buckets(33) for n, t in b}
        assert all(torch.equal(got[n], t) for n, t in want.items())
        assert client.released == [3]

    asyncio.run(main())
