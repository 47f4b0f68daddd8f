"""The object_store transport's publish format without Ray: one object per bucket holding the
bucket's arrays, fingerprints split over threads, buckets put two at once (in bucket order in the
manifest; a failed put registers nothing), and the fetch side reading both this format and the
older one object per tensor (a fake object store stands in for ray.put / ray.get)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import types
from typing import Any

import numpy as np
import pytest
import torch

from meshrl.v1 import common_pb2
from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import DataLoss, InvalidArgument
from services.weights.layout import Fingerprinter, fingerprint_bytes, plan_bucket
from services.weights.packing import pack_bucket
from services.weights.transports import object_store as osx

HERE, ELSEWHERE = "a1" * 28, "b2" * 28  # node ids as Ray writes them (hex of 28 bytes)


class FakeRef:
    """An object ref: an id and the node of its owner (the process that put it)."""

    def __init__(self, n: int, owner_node: str) -> None:
        self.n, self.owner_node = n, owner_node

    def owner_address(self) -> bytes:
        from ray.core.generated.common_pb2 import Address

        return Address(node_id=bytes.fromhex(self.owner_node), ip_address="10.0.0.1", port=1).SerializeToString()  # type: ignore[no-any-return]


class FakeRay:
    """ray.put / ray.get over a dict; values are kept as put (no copy, as on one node). The
    fetcher runs on node HERE; `owner_node` is where puts come from."""

    class exceptions:  # mirrors ray.exceptions
        class GetTimeoutError(Exception):
            """ray.exceptions.GetTimeoutError"""

        class ObjectLostError(Exception):
            """ray.exceptions.ObjectLostError"""

    def __init__(self) -> None:
        self.objects: dict[FakeRef, Any] = {}
        self.ids = itertools.count()
        self.owner_node = HERE

    def put(self, value: Any) -> FakeRef:
        ref = FakeRef(next(self.ids), self.owner_node)
        self.objects[ref] = value
        return ref

    def get(self, refs: list[FakeRef], timeout: float | None = None) -> list[Any]:
        return [self.objects[r] for r in refs]

    def get_runtime_context(self) -> Any:
        return types.SimpleNamespace(get_node_id=lambda: HERE)


class FakeDirectory:
    def __init__(self) -> None:
        self.versions: dict[int, tuple[bytes, list[Any]]] = {}
        self.released: list[tuple[int, str]] = []

    async def register(self, manifest: pb.Manifest, refs: list[Any]) -> None:
        self.versions[manifest.policy_version] = (manifest.SerializeToString(), refs)

    async def lookup(self, policy_version: int, consumer_id: str) -> tuple[pb.Manifest, list[Any]]:
        raw, refs = self.versions[policy_version]
        return pb.Manifest.FromString(raw), refs

    async def release(self, policy_version: int, consumer_id: str) -> None:
        self.released.append((policy_version, consumer_id))


def weights() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)
    return [
        [("a", torch.randn(300, 7, generator=g).bfloat16()), ("b", torch.randn(33, generator=g)),
         ("c", torch.tensor([True, False, True]))],
        [("d", torch.randn(1000, generator=g).double())],
    ]


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    fake = FakeRay()
    monkeypatch.setattr(osx, "_ray", lambda: fake)
    return fake


@pytest.mark.parametrize("sizes", [[1000, 37, 12293], [8], [1], [33, 7, 100003], [64] * 5, [0, 16, 0]])
@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7])
def test_a_fingerprint_split_over_threads_is_the_one_pass_fingerprint(sizes: list[int], threads: int) -> None:
    rng = np.random.default_rng(sum(sizes) + threads)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    pairs = list(zip(offsets, arrays, strict=True))
    runs = osx._split(pairs, threads)
    assert len(runs) <= max(1, threads) and sum(a.nbytes for run in runs for _, a in run) == sum(sizes)
    assert asyncio.run(osx._fingerprint(sum(sizes), pairs, threads)) == fingerprint_bytes(np.concatenate(arrays))


def test_a_split_fingerprint_covers_gaps_between_pieces_like_zero_bytes() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 256, 100, dtype=np.uint8), rng.integers(0, 256, 51, dtype=np.uint8)
    whole = np.zeros(300, dtype=np.uint8)
    whole[:100], whole[249:] = a, b
    got = asyncio.run(osx._fingerprint(300, [(0, a), (249, b)], 3))
    assert got == fingerprint_bytes(whole)


def test_merging_fingerprints_of_different_byte_strings_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"other\.nbytes"):
        Fingerprinter(16).merge(Fingerprinter(24))


def test_publish_puts_one_object_per_bucket_and_fetch_reads_it_back_verified(fake_ray: FakeRay) -> None:
    directory = FakeDirectory()

    async def main() -> dict[str, torch.Tensor]:
        ref = await osx.ObjectStorePublisher(directory).publish(1, weights())
        _, refs = directory.versions[1]
        assert [len(r) for r in refs] == [1, 1]  # one put per bucket, not one per tensor
        assert all(isinstance(fake_ray.objects[r[0]], list) for r in refs)
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="c", verify="always")
        got = {n: t.clone() async for b in fetcher.fetch(ref) for n, t in b}
        await fetcher.settle()  # the release runs beside the caller once the last bucket is out
        assert fetcher.verified_buckets == 2 and directory.released == [(1, "c")]
        return got

    got = asyncio.run(main())
    want = {n: t for b in weights() for n, t in b}
    assert set(got) == set(want) and all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in want.items())


def test_fetch_still_reads_versions_put_one_object_per_tensor(fake_ray: FakeRay) -> None:
    directory = FakeDirectory()

    async def main() -> None:
        ref = await osx.ObjectStorePublisher(directory).publish(1, weights())
        raw, refs = directory.versions[1]
        per_tensor = [[fake_ray.put(a) for a in fake_ray.objects[r[0]]] for r in refs]  # the older layout
        directory.versions[1] = (raw, per_tensor)
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="c", verify="always")
        got = {n: t.clone() async for b in fetcher.fetch(ref) for n, t in b}
        assert torch.equal(got["d"], weights()[1][0][1]) and fetcher.verified_buckets == 2

    asyncio.run(main())


def test_a_packed_bucket_is_put_as_one_array_and_read_back_as_views_of_it(fake_ray: FakeRay) -> None:
    directory = FakeDirectory()
    packed = [pack_bucket(b) for b in weights()]

    async def main() -> None:
        ref = await osx.ObjectStorePublisher(directory).publish(1, packed)
        _, refs = directory.versions[1]
        objects = [fake_ray.objects[r[0]] for r in refs]
        assert [[a.nbytes for a in o] for o in objects] == [[plan_bucket(0, b)[1]] for b in weights()]
        for verify in ("always", "remote"):  # read with and without the fingerprint
            fetcher = osx.ObjectStoreFetcher(directory, consumer_id=verify, verify=verify)
            async for bucket in fetcher.fetch(ref):
                i = 0 if bucket[0][0] == "a" else 1
                start = objects[i][0].ctypes.data
                for name, t in bucket:  # views of the one array: nothing copied
                    assert start <= t.data_ptr() < start + objects[i][0].nbytes or not t.numel(), name
                    want = dict(weights()[i])[name]
                    assert t.dtype == want.dtype and torch.equal(t, want), name
            assert fetcher.verified_buckets == (2 if verify == "always" else 0)

    asyncio.run(main())


def test_a_packed_buckets_fingerprint_is_its_packers_and_a_loose_one_is_read(fake_ray: FakeRay,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The publish reads no byte of a bucket its packer fingerprinted (packing.py); the manifest
    holds the bytes' fingerprint either way."""
    read: list[int] = []
    real = osx._fingerprint

    async def counting(nbytes: int, arrays: list[tuple[int, np.ndarray]], threads: int = 2) -> str:
        read.append(nbytes)
        return await real(nbytes, arrays, threads)

    monkeypatch.setattr(osx, "_fingerprint", counting)
    directory = FakeDirectory()
    packed, loose = pack_bucket(weights()[0]), weights()[1]

    async def main() -> None:
        ref = await osx.ObjectStorePublisher(directory).publish(1, [packed, loose])
        manifest = pb.Manifest.FromString(directory.versions[1][0])
        assert [b.fingerprint for b in manifest.buckets] == [packed.fingerprint, fingerprint_bytes(pack_bucket(loose).buffer.numpy())]
        assert packed.fingerprint == fingerprint_bytes(packed.buffer.numpy())
        assert read == [plan_bucket(1, loose)[1]]  # the loose bucket only
        got = [b async for b in osx.ObjectStoreFetcher(directory, consumer_id="c", verify="always").fetch(ref)]
        assert len(got) == 2

    asyncio.run(main())


def test_a_bucket_already_in_the_store_is_registered_without_a_put(fake_ray: FakeRay) -> None:
    """A rank's export as it crossed (packing.from_wire with `stored`): its object holds the
    bucket's WireBucket; the publisher registers that ref and puts nothing; readers get the
    bucket whole, checked or not; runs that do not tile the bucket are DataLoss."""
    from services.weights.packing import WireBucket, from_wire, to_wire

    directory = FakeDirectory()
    stored = []
    for b in weights():
        ref = fake_ray.put(to_wire(pack_bucket(b)))
        stored.append(from_wire(fake_ray.get([ref])[0], stored=ref))
    objects = len(fake_ray.objects)

    async def main() -> None:
        ref = await osx.ObjectStorePublisher(directory).publish(1, stored)
        assert len(fake_ray.objects) == objects  # no put
        assert [r[0] for r in directory.versions[1][1]] == [b.stored for b in stored]
        for verify in ("always", "remote"):
            fetcher = osx.ObjectStoreFetcher(directory, consumer_id=verify, verify=verify)
            got = {n: t.clone() async for bucket in fetcher.fetch(ref) for n, t in bucket}
            assert all(torch.equal(got[n], t) for b in weights() for n, t in b)
            assert fetcher.verified_buckets == (2 if verify == "always" else 0)
        wire = fake_ray.objects[stored[0].stored]
        fake_ray.objects[stored[0].stored] = WireBucket([(0, wire.runs[0][1][:8]), (9, wire.runs[0][1][9:])], wire.metas)
        with pytest.raises(DataLoss, match="not back to back"):
            [b async for b in osx.ObjectStoreFetcher(directory, consumer_id="gap", verify="always").fetch(ref)]

    asyncio.run(main())


@pytest.mark.parametrize("cuts", [[], [1], [2], [1, 2], [0, 1, 2, 3]])
def test_the_arrays_of_an_object_may_split_its_bucket_between_any_tensors(fake_ray: FakeRay, cuts: list[int]) -> None:
    directory = FakeDirectory()

    async def main() -> None:
        ref = await osx.ObjectStorePublisher(directory).publish(1, [pack_bucket(weights()[0])])
        raw, refs = directory.versions[1]
        whole = fake_ray.objects[refs[0][0]][0]
        metas = sorted(plan_bucket(0, weights()[0])[0], key=lambda m: m.offset)
        bounds = [0, *(metas[c].offset for c in cuts if c < len(metas)), whole.nbytes]
        pieces = [whole[a:b].copy() for a, b in itertools.pairwise(sorted(set(bounds)))]
        directory.versions[1] = (raw, [[fake_ray.put(pieces)]])
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="c", verify="always")
        got = {n: t.clone() async for b in fetcher.fetch(ref) for n, t in b}
        assert all(torch.equal(got[n], t) for n, t in weights()[0])

    asyncio.run(main())


@pytest.mark.parametrize(("cut", "error"), [(5, "is not inside one of the object's arrays"), (None, "holds")])
def test_an_object_whose_arrays_cut_a_tensor_or_miss_bytes_is_data_loss(fake_ray: FakeRay, cut: int | None,
                                                                        error: str) -> None:
    directory = FakeDirectory()

    async def main() -> None:
        ref = await osx.ObjectStorePublisher(directory).publish(1, [pack_bucket(weights()[0])])
        raw, refs = directory.versions[1]
        whole = fake_ray.objects[refs[0][0]][0]
        pieces = [whole[:cut], whole[cut:]] if cut is not None else [whole[:-8]]
        directory.versions[1] = (raw, [[fake_ray.put(pieces)]])
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="c", verify="remote", max_attempts=1)
        with pytest.raises(DataLoss, match=error):
            [b async for b in fetcher.fetch(ref)]

    asyncio.run(main())


def test_a_corrupted_object_fails_its_fingerprint(fake_ray: FakeRay) -> None:
    directory = FakeDirectory()

    async def main() -> None:
        ref = await osx.ObjectStorePublisher(directory).publish(1, weights())
        _, refs = directory.versions[1]
        arrays = fake_ray.objects[refs[1][0]]
        arrays[0] = arrays[0].copy()
        arrays[0][5] ^= 1
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="c", verify="always", max_attempts=1)
        with pytest.raises(osx.DataLoss, match="fingerprint"):
            [b async for b in fetcher.fetch(ref)]

    asyncio.run(main())


def test_a_manifest_that_does_not_match_its_checksum_is_refused_before_a_bucket(fake_ray: FakeRay) -> None:
    """The ref names a version by its manifest's checksum, and the fingerprints the buckets are
    checked against come from that manifest: one whose content no longer matches the checksum
    (here a bucket's bytes and its fingerprint both changed, the checksum kept) must not pass."""
    directory = FakeDirectory()

    async def main() -> None:
        ref = await osx.ObjectStorePublisher(directory).publish(1, weights())
        raw, refs = directory.versions[1]
        arrays = fake_ray.objects[refs[1][0]]
        arrays[0] = arrays[0].copy()
        arrays[0][5] ^= 1
        forged = pb.Manifest.FromString(raw)
        forged.buckets[1].fingerprint = fingerprint_bytes(arrays[0].tobytes())
        directory.versions[1] = (forged.SerializeToString(), refs)
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="c", verify="always", max_attempts=1)
        with pytest.raises(DataLoss, match=r"manifest\.checksum"):
            await anext(fetcher.fetch(ref))
        await fetcher.settle()
        assert directory.released == [(1, "c")]  # refused, and its hold goes

    asyncio.run(main())


def test_only_objects_put_on_this_node_are_read_unverified(fake_ray: FakeRay) -> None:
    """`remote`: an object put on the fetcher's node is the publisher's own bytes (mapped, never
    transferred); one put elsewhere is fingerprinted, and a corrupted one fails."""
    directory = FakeDirectory()

    async def fetch_all(version: int, **kw: Any) -> tuple[int, dict[str, torch.Tensor]]:
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id=f"c{version}", verify="remote", **kw)
        ref = await osx.ObjectStorePublisher(directory).publish(version, weights())
        got = {n: t.clone() async for b in fetcher.fetch(ref) for n, t in b}
        return fetcher.verified_buckets, got

    async def main() -> None:
        assert (await fetch_all(1))[0] == 0
        fake_ray.owner_node = ELSEWHERE
        verified, got = await fetch_all(2)
        assert verified == 2 and torch.equal(got["d"], weights()[1][0][1])
        ref = await osx.ObjectStorePublisher(directory).publish(3, weights())
        _, refs = directory.versions[3]
        fake_ray.objects[refs[1][0]][0][3] ^= 1  # a copy pulled from the other node, corrupted
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="c", verify="remote", max_attempts=1)
        with pytest.raises(osx.DataLoss, match="fingerprint"):
            [b async for b in fetcher.fetch(ref)]

    asyncio.run(main())


def test_an_owner_that_cannot_be_read_means_verify() -> None:
    class Opaque:
        def owner_address(self) -> bytes:
            return b"\xff not an address"

    ray = types.SimpleNamespace(get_runtime_context=lambda: types.SimpleNamespace(get_node_id=lambda: HERE))
    assert osx._put_here(ray, [FakeRef(0, HERE), FakeRef(1, ELSEWHERE), Opaque()]) == [True, False, False]
    assert osx._put_here(types.SimpleNamespace(), [FakeRef(0, HERE)]) == [False]  # no runtime context


class GatedDirectory(FakeDirectory):
    """Releases wait for `gate` (or fail when `fail` is set); lookups are recorded in order."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.fail = False
        self.calls: list[str] = []

    async def lookup(self, policy_version: int, consumer_id: str) -> tuple[pb.Manifest, list[Any]]:
        self.calls.append(f"lookup {policy_version}")
        return await super().lookup(policy_version, consumer_id)

    async def release(self, policy_version: int, consumer_id: str) -> None:
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("param server unreachable")
        self.calls.append(f"release {policy_version}")
        await super().release(policy_version, consumer_id)


def test_a_fetch_releases_its_hold_after_the_last_bucket_and_the_next_fetch_waits_for_it(fake_ray: FakeRay) -> None:
    directory = GatedDirectory()

    async def main() -> None:
        pub = osx.ObjectStorePublisher(directory)
        ref1, ref2 = await pub.publish(1, weights()), await pub.publish(2, weights())
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="c", verify="always")
        assert len([b async for b in fetcher.fetch(ref1)]) == 2  # returns with the release pending
        assert directory.calls == ["lookup 1"] and directory.released == []
        second = asyncio.ensure_future(_count(fetcher.fetch(ref2)))
        await asyncio.sleep(0.01)
        assert directory.calls == ["lookup 1"]  # held back until version 1's release lands
        directory.gate.set()
        assert await second == 2
        await fetcher.close()
        assert directory.calls == ["lookup 1", "release 1", "lookup 2", "release 2"]
        assert directory.released == [(1, "c"), (2, "c")] and fetcher.release_failures == 0

    asyncio.run(main())


def test_an_abandoned_fetch_still_releases_and_a_failed_release_is_counted(fake_ray: FakeRay) -> None:
    directory = GatedDirectory()
    directory.gate.set()

    async def main() -> None:
        pub = osx.ObjectStorePublisher(directory)
        ref1, ref2 = await pub.publish(1, weights()), await pub.publish(2, weights())
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="c", verify="always")
        stream = fetcher.fetch(ref1)
        async for _ in stream:
            break  # the consumer stops after the first bucket
        await stream.aclose()
        await fetcher.settle()
        assert directory.released == [(1, "c")]
        directory.fail = True
        assert await _count(fetcher.fetch(ref2)) == 2
        await fetcher.close()  # the failure is logged and counted, not raised: the hold's TTL frees it
        assert fetcher.release_failures == 1 and directory.released == [(1, "c")]

    asyncio.run(main())


async def _count(stream: Any) -> int:
    return len([b async for b in stream])


class GatedRay(FakeRay):
    """ray.put blocks until its bucket's gate opens (or raises for the bucket in `fail`); records
    how many puts ran at once."""

    def __init__(self, buckets: int) -> None:
        super().__init__()
        self.gates = [threading.Event() for _ in range(buckets)]
        self.started = [threading.Event() for _ in range(buckets)]
        self.fail: int | None = None
        self.running = self.most = 0
        self.lock = threading.Lock()

    def put(self, value: Any) -> int:
        n = int(value[0].nbytes)  # each test bucket's first array has a distinct size: its index
        index = SIZES.index(n)
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.started[index].set()
        try:
            assert self.gates[index].wait(5)
            if self.fail == index:
                raise RuntimeError(f"object store full at bucket {index}")
            return super().put(value)
        finally:
            with self.lock:
                self.running -= 1


SIZES = [4096, 8192, 12288]


def three_buckets() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    return [[(f"w{i}", torch.randn(n // 4, generator=g)), (f"b{i}", torch.randn(3, generator=g))]
            for i, n in enumerate(SIZES)]


def test_two_buckets_are_put_at_once_and_the_manifest_keeps_bucket_order(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = GatedRay(3)
    monkeypatch.setattr(osx, "_ray", lambda: fake)
    directory = FakeDirectory()

    async def main() -> dict[str, torch.Tensor]:
        publish = asyncio.ensure_future(osx.ObjectStorePublisher(directory, puts_in_flight=2).publish(1, three_buckets()))
        assert await asyncio.to_thread(fake.started[1].wait, 5)  # bucket 1 went in while bucket 0 was still copying
        assert not fake.started[2].is_set()  # no third: two in flight at most
        for gate in reversed(fake.gates):  # the later buckets finish first
            gate.set()
            await asyncio.sleep(0.01)
        ref = await publish
        raw, refs = directory.versions[1]
        assert [b.index for b in pb.Manifest.FromString(raw).buckets] == [0, 1, 2]
        assert [fake.objects[r[0]][0].nbytes for r in refs] == SIZES  # refs in bucket order
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="c", verify="always")
        got = {n: t.clone() async for b in fetcher.fetch(ref) for n, t in b}
        await fetcher.close()
        return got

    got = asyncio.run(main())
    assert fake.most == 2
    want = {n: t for b in three_buckets() for n, t in b}
    assert set(got) == set(want) and all(torch.equal(got[n], t) for n, t in want.items())


def test_one_bucket_in_flight_puts_them_one_after_another(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = GatedRay(3)
    for gate in fake.gates:
        gate.set()
    monkeypatch.setattr(osx, "_ray", lambda: fake)
    directory = FakeDirectory()
    asyncio.run(osx.ObjectStorePublisher(directory, puts_in_flight=1).publish(1, three_buckets()))
    assert fake.most == 1 and [len(r) for r in directory.versions[1][1]] == [1, 1, 1]


def test_a_failed_put_fails_the_publish_and_registers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = GatedRay(3)
    fake.fail = 1
    for gate in fake.gates:
        gate.set()
    monkeypatch.setattr(osx, "_ray", lambda: fake)
    directory = FakeDirectory()
    with pytest.raises(RuntimeError, match="object store full at bucket 1"):
        asyncio.run(osx.ObjectStorePublisher(directory, puts_in_flight=2).publish(1, three_buckets()))
    assert directory.versions == {}


def test_puts_in_flight_must_be_positive() -> None:
    with pytest.raises(InvalidArgument, match="puts_in_flight"):
        osx.ObjectStorePublisher(FakeDirectory(), puts_in_flight=0)


def test_a_refused_fetch_of_the_newest_releases_the_version_it_pinned(fake_ray: FakeRay) -> None:
    """A cold consumer asks for the newest (-1): the hold is on the version the lookup pinned, and a
    manifest the ref refuses must release that one, not -1."""

    class Newest(FakeDirectory):
        async def lookup(self, policy_version: int, consumer_id: str) -> tuple[pb.Manifest, list[Any]]:
            return await super().lookup(max(self.versions) if policy_version < 0 else policy_version, consumer_id)

    directory = Newest()

    async def main() -> None:
        await osx.ObjectStorePublisher(directory).publish(4, weights())
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="c")
        wrong = common_pb2.WeightsRef(policy_version=-1, manifest_checksum="0" * 64)
        with pytest.raises(DataLoss, match="republished"):
            await anext(fetcher.fetch(wrong))  # refused before its first bucket
        await fetcher.settle()
        assert directory.released == [(4, "c")]

    asyncio.run(main())


def test_a_lookup_that_times_out_after_the_hold_was_taken_releases_it(fake_ray: FakeRay) -> None:
    """The param server pinned the version, the reply came too late: the fetch fails, and the
    hold goes with it (it was kept for hold_ttl_s, past retention)."""

    class SlowDirectory(FakeDirectory):
        async def lookup(self, policy_version: int, consumer_id: str) -> tuple[pb.Manifest, list[Any]]:
            await asyncio.sleep(5)  # the hold is taken on the server; the reply is late
            return await super().lookup(policy_version, consumer_id)

    directory = SlowDirectory()

    async def main() -> None:
        fetcher = osx.ObjectStoreFetcher(directory, consumer_id="rollout-0", timeout_s=0.2)
        with pytest.raises(Exception):  # noqa: B017 - the deadline's error, whatever its class
            async for _ in fetcher.fetch(common_pb2.WeightsRef(policy_version=4)):
                pass
        await fetcher.settle()

    asyncio.run(main())
    assert directory.released == [(4, "rollout-0")]
