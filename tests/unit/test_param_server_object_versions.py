"""The param server's object_store door without Ray: registrations arrive in the background, so a
lookup of a version newer than the newest waits (bounded) for its registration; everything else
answers at once, as before."""

from __future__ import annotations

import asyncio

import pytest
import torch

from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.param_server.object_versions import ObjectVersions
from services.param_server.store import StoreSettings, WeightStore
from services.weights import convert
from services.weights.layout import BucketMeta, build_manifest, fingerprint_tensor, pack_into, plan_bucket


def manifest(version: int, value: float = 1.0) -> bytes:
    bucket = [("w", torch.full((4, 4), value))]
    metas, n = plan_bucket(0, bucket)
    buf = torch.empty(n, dtype=torch.uint8)
    pack_into(buf, bucket, metas)
    m = build_manifest(version, metas, [BucketMeta(0, n, fingerprint_tensor(buf, n))], transports=["object_store"])
    return convert.manifest_to_proto(m).SerializeToString()  # type: ignore[no-any-return]


def versions() -> ObjectVersions:
    return ObjectVersions(WeightStore(StoreSettings(retain_versions=2)))


def test_a_lookup_that_arrives_before_the_registration_waits_for_it() -> None:
    ov = versions()

    async def main() -> None:
        ov.register(manifest(1), [["ref-1"]])
        early = asyncio.ensure_future(ov.lookup(2, "c", wait_s=5.0))
        await asyncio.sleep(0.01)
        assert not early.done()
        ov.register(manifest(2), [["ref-2"]])
        raw, refs = await early
        assert convert.manifest_from_proto(pb.Manifest.FromString(raw)).policy_version == 2
        assert refs == [["ref-2"]]
        assert ov.store.get(2).holds.keys() == {"c"}  # pinned like any lookup

    asyncio.run(main())


def test_a_registration_that_never_comes_ends_the_wait_with_not_found_naming_the_version() -> None:
    ov = versions()

    async def main() -> None:
        waiting = asyncio.ensure_future(ov.lookup(3, "c", wait_s=0.2))
        await asyncio.sleep(0.01)
        ov.register(manifest(1), [["ref-1"]])  # another version: the lookup checks again, keeps waiting
        with pytest.raises(NotFound, match="version 3 was not registered within"):
            await waiting

    asyncio.run(main())


def test_lookups_of_evicted_or_unknown_older_versions_and_of_the_newest_answer_at_once() -> None:
    ov = versions()

    async def main() -> None:
        for v in (1, 2, 3):
            ov.register(manifest(v, float(v)), [[f"ref-{v}"]])
        with pytest.raises(NotFound, match="not held"):  # evicted (retain 2): no wait
            await asyncio.wait_for(ov.lookup(1, "c", wait_s=30.0), timeout=1.0)
        _, refs = await asyncio.wait_for(ov.lookup(-1, "c", wait_s=30.0), timeout=1.0)
        assert refs == [["ref-3"]]
        empty = versions()
        with pytest.raises(NotFound, match="no version"):
            await asyncio.wait_for(empty.lookup(-1, "c", wait_s=30.0), timeout=1.0)
        with pytest.raises(NotFound):  # no wait asked: the answer of before
            await empty.lookup(1, "c")

    asyncio.run(main())


def test_a_rejected_registration_leaves_no_trace_and_bad_waits_are_refused() -> None:
    ov = versions()

    async def main() -> None:
        ov.register(manifest(1), [["ref-1"]])
        await ov.lookup(1, "c")  # seen: version 1 is immutable now
        with pytest.raises(FailedPrecondition, match="different content"):
            ov.register(manifest(1, 2.0), [["other"]])
        _, refs = await ov.lookup(1, "c")
        assert refs == [["ref-1"]]
        for bad in (-1.0, float("inf"), float("nan")):
            with pytest.raises(InvalidArgument, match="wait_s"):
                await ov.lookup(1, "c", wait_s=bad)

    asyncio.run(main())
