"""The grpc transport over real gRPC on loopback: a plain param server, real publishers and
fetchers, and a real TCP proxy that corrupts or freezes the bytes in flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import torch

from meshrl.v1 import common_pb2
from meshrl.v1 import param_server_pb2 as pb
from services.common.config.param_server import ParamServerConfig
from services.common.errors import DataLoss, DeadlineExceeded, FailedPrecondition, NotFound, Unavailable
from services.param_server.server import ParamServerServer
from services.weights.client import ParamServerClient
from services.weights.transports.grpc import GrpcFetcher, GrpcPublisher

from .netfault import FaultyProxy

MARKER = b"MESHRL-CORRUPT-ME-0123456789abcdef"


def buckets(seed: int, big: int = 200_000) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [("model.embed_tokens.weight", torch.randn(big // 100, 50, generator=g).bfloat16()),
         ("model.norm.weight", torch.randn(50, generator=g))],
        [("model.layers.0.self_attn.q_proj.weight", torch.randn(big // 50, 50, generator=g)),
         ("marker", torch.frombuffer(bytearray(MARKER * 50), dtype=torch.uint8)),
         ("flag", torch.tensor(True))],
        [("lm_head.weight", torch.randn(30, 50, generator=g).bfloat16())],
    ]


def expected(seed: int) -> dict[str, torch.Tensor]:
    return {n: t for b in buckets(seed) for n, t in b}


async def fetch_all(fetcher: GrpcFetcher, ref: common_pb2.WeightsRef) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    async for bucket in fetcher.fetch(ref):
        for name, t in bucket:
            out[name] = t.clone()  # tensors are valid until the next bucket
    return out


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


async def start_server(**overrides: object) -> ParamServerServer:
    server = ParamServerServer(ParamServerConfig(port=0, **overrides))  # type: ignore[arg-type]
    await server.start()
    return server


def run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=120))  # type: ignore[arg-type]


def test_round_trip_is_bit_exact_with_dtypes_and_cold_start_and_name_filter() -> None:
    async def main() -> None:
        server = await start_server()
        pub = GrpcPublisher(server.address, chunk_bytes=64 * 1024)
        fetcher = GrpcFetcher(consumer_id="rollout-0", chunk_bytes=100_000)
        try:
            ref = await pub.publish(1, buckets(1))
            assert ref.param_server_address == server.address and ref.total_bytes > 0
            assert_identical(await fetch_all(fetcher, ref), expected(1))
            async def exported() -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
                for b in buckets(2):  # the trainer may hand an async iterable too
                    yield b

            await pub.publish(2, exported())
            async with ParamServerClient(server.address) as client:
                newest = await client.newest_ref()
                assert newest.policy_version == 2
                versions = [v.policy_version for v in await client.list_versions()]
                assert versions == [1, 2]
            # a replica joining late asks for "the newest"
            cold = await fetch_all(fetcher, common_pb2.WeightsRef(policy_version=-1, param_server_address=server.address))
            assert_identical(cold, expected(2))
            only = GrpcFetcher(server.address, consumer_id="rollout-1", names=["lm_head.weight"])
            got = await fetch_all(only, common_pb2.WeightsRef(policy_version=2))
            assert list(got) == ["lm_head.weight"] and torch.equal(got["lm_head.weight"], expected(2)["lm_head.weight"])
            await only.close()
            with pytest.raises(NotFound, match="not held"):
                await fetch_all(fetcher, common_pb2.WeightsRef(policy_version=7, param_server_address=server.address))
            stale = common_pb2.WeightsRef(policy_version=2, param_server_address=server.address, manifest_checksum="0" * 64)
            with pytest.raises(DataLoss, match="republished"):
                await fetch_all(fetcher, stale)
            assert "rollout-0" not in server.servicer.store.get(2).holds  # the refused fetch let go of its pin
        finally:
            await pub.close()
            await fetcher.close()
            await server.stop()

    run(main())


def test_packed_buckets_go_from_their_own_buffers_with_their_packers_fingerprints(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket the export packed and fingerprinted (packing.py) is streamed as it lies: not copied,
    not read before it goes; the server still checks every byte against that fingerprint, so a
    buffer written after packing fails the publish instead of reaching a rollout."""
    from services.weights.packing import pack_bucket
    from services.weights.transports import grpc as grpc_transport

    real = grpc_transport.pack_into
    copied: list[int] = []
    monkeypatch.setattr(grpc_transport, "pack_into", lambda buf, named, metas: (copied.append(len(named)), real(buf, named, metas)))

    async def main() -> None:
        server = await start_server()
        pub = GrpcPublisher(server.address, chunk_bytes=64 * 1024)
        fetcher = GrpcFetcher(consumer_id="rollout-0")
        try:
            packed = [pack_bucket(b) for b in buckets(1)[:2]] + buckets(1)[2:]  # the last one loose
            ref = await pub.publish(1, packed)
            assert copied == [1]  # only the loose bucket was copied into the publisher's buffer
            assert_identical(await fetch_all(fetcher, ref), expected(1))
            async with ParamServerClient(server.address) as client:
                manifest = await client.get_manifest(1)
            assert [b.fingerprint for b in manifest.buckets[:2]] == [b.fingerprint for b in packed[:2]]
            spoiled = [pack_bucket(b) for b in buckets(2)]
            spoiled[1].buffer[5] ^= 0xFF  # written after its fingerprint was taken
            with pytest.raises(DataLoss, match="bucket 1"):
                await pub.publish(2, spoiled)
            async with ParamServerClient(server.address) as client:
                assert [v.policy_version for v in await client.list_versions()] == [1]
        finally:
            await pub.close()
            await fetcher.close()
            await server.stop()

    run(main())


def test_a_bucket_corrupted_in_flight_is_detected_and_fetched_again() -> None:
    async def main() -> None:
        server = await start_server()
        proxy = await FaultyProxy(server.address).start()
        pub = GrpcPublisher(server.address)
        fetcher = GrpcFetcher(consumer_id="rollout-0")
        try:
            ref = await pub.publish(1, buckets(1))
            proxy.corrupt_once(MARKER, "down")
            via_proxy = common_pb2.WeightsRef()
            via_proxy.CopyFrom(ref)
            via_proxy.param_server_address = proxy.address
            assert_identical(await fetch_all(fetcher, via_proxy), expected(1))
            assert proxy.corrupted == 1 and fetcher.refetched_buckets == 1
        finally:
            await pub.close()
            await fetcher.close()
            await proxy.stop()
            await server.stop()

    run(main())


def test_an_upload_corrupted_in_flight_is_rejected_and_nothing_is_published() -> None:
    async def main() -> None:
        server = await start_server()
        proxy = await FaultyProxy(server.address).start()
        pub = GrpcPublisher(proxy.address)
        try:
            proxy.corrupt_once(MARKER, "up")
            with pytest.raises(DataLoss, match="bucket 1"):
                await pub.publish(1, buckets(1))
            assert proxy.corrupted == 1
            assert server.servicer.store.versions() == [] and not server.servicer.store._uploads
            await pub.publish(1, buckets(1))  # a retry goes through
        finally:
            await pub.close()
            await proxy.stop()
            await server.stop()

    run(main())


def test_a_stuck_server_gives_deadline_exceeded_to_the_fetcher() -> None:
    async def main() -> None:
        server = await start_server()
        proxy = await FaultyProxy(server.address).start()
        pub = GrpcPublisher(server.address)
        fetcher = GrpcFetcher(consumer_id="rollout-0", stall_timeout_s=1.0, chunk_bytes=64 * 1024)
        try:
            ref = await pub.publish(1, buckets(1))
            ref.param_server_address = proxy.address
            proxy.stall("down", after_bytes=300_000)
            start = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="no progress"):
                await fetch_all(fetcher, ref)
            assert time.monotonic() - start < 30
            deadline = time.monotonic() + 20  # the server side lets go of the version too
            while server.servicer.store.get(1).readers and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert server.servicer.store.get(1).readers == 0
        finally:
            await pub.close()
            await fetcher.close()
            await proxy.stop()
            await server.stop()

    run(main())


def test_a_publisher_that_stops_sending_gets_deadline_exceeded_and_leaves_nothing() -> None:
    async def main() -> None:
        server = await start_server(stall_timeout_s=1.0)
        try:
            async with ParamServerClient(server.address) as client:

                async def stops() -> AsyncIterator[pb.PublishWeightsRequest]:
                    yield pb.PublishWeightsRequest(bucket=pb.BucketMeta(index=0, nbytes=1000, fingerprint="0" * 32))
                    yield pb.PublishWeightsRequest(chunk=pb.WeightsChunk(policy_version=3, data=b"x" * 100))
                    await asyncio.sleep(3600)  # the trainer hangs mid-upload

                with pytest.raises(DeadlineExceeded, match="stopped sending"):
                    await client.publish(stops(), timeout_s=60)
            assert server.servicer.store.versions() == [] and not server.servicer.store._uploads
        finally:
            await server.stop()

    run(main())


def test_an_export_that_fails_mid_publish_raises_its_own_error_and_leaves_nothing() -> None:
    """A rank that dies while its weights stream out: the trainer must see why (grpc.aio only
    says CancelledError when the request iterator raises), and no part of the version is kept."""

    async def main() -> None:
        server = await start_server()
        try:
            pub = GrpcPublisher(server.address, chunk_bytes=64 * 1024)

            async def dies() -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
                yield buckets(1)[0]
                raise RuntimeError("ActorDiedError: the actor died unexpectedly (TrainWorker)")

            with pytest.raises(RuntimeError, match="TrainWorker"):
                await pub.publish(4, dies())
            assert server.servicer.store.versions() == []
            await pub.close()
        finally:
            await server.stop()

    run(main())


def test_retention_keeps_a_version_while_it_is_being_fetched() -> None:
    async def main() -> None:
        server = await start_server(retain_versions=1)
        pub = GrpcPublisher(server.address)
        fetcher = GrpcFetcher(consumer_id="slow-rollout")
        try:
            ref1 = await pub.publish(1, buckets(1))
            got: dict[str, torch.Tensor] = {}
            stream = fetcher.fetch(ref1)
            for name, t in await stream.__anext__():
                got[name] = t.clone()
            for v in (2, 3):  # newer versions arrive while the slow rollout is mid-fetch
                await pub.publish(v, buckets(v))
            store = server.servicer.store
            assert [s.policy_version for s in store.versions()] == [1, 3]
            async for bucket in stream:
                for name, t in bucket:
                    got[name] = t.clone()
            assert_identical(got, expected(1))
            store.sweep(time.time())
            assert [s.policy_version for s in store.versions()] == [3]
            with pytest.raises(NotFound, match="evicted"):
                await fetch_all(fetcher, ref1)
            assert_identical(await fetch_all(fetcher, await pub.publish(3, buckets(3))), expected(3))
            with pytest.raises(FailedPrecondition, match="immutable once seen"):
                await pub.publish(3, buckets(99))  # a consumer has the version: no other content
        finally:
            await pub.close()
            await fetcher.close()
            await server.stop()

    run(main())


def test_an_abandoned_fetch_never_writes_into_the_next_and_a_closed_channel_ends_a_fetch() -> None:
    """Two defects of the fetcher's two shared receive buffers and its stream task:
    - a fetch dropped mid-version (its generator kept, never closed) left its stream writing into
      the buffers the next fetch reads; the next stream now stops it first;
    - a channel closed under a fetch (close() elsewhere) made grpc.aio raise CancelledError in
      the stream task, which put nothing on the consumer's queue: the fetch hung until an outer
      timeout. It now ends with Unavailable."""
    async def main() -> None:
        server = await start_server()
        pub = GrpcPublisher(server.address, chunk_bytes=16 * 1024)
        fetcher = GrpcFetcher(consumer_id="rollout-0", chunk_bytes=16 * 1024)
        try:
            ref1 = await pub.publish(1, buckets(1, big=2_000_000))
            ref2 = await pub.publish(2, buckets(2, big=2_000_000))
            dropped = fetcher.fetch(ref1)
            await anext(dropped)  # one bucket in, the stream goes on into the other buffer
            assert_identical(await fetch_all(fetcher, ref2), {n: t for b in buckets(2, big=2_000_000) for n, t in b})
            await dropped.aclose()

            closing = fetcher.fetch(ref2)
            await anext(closing)
            await fetcher._client(server.address).close()  # the channel goes under the fetch
            with pytest.raises(Unavailable):
                await asyncio.wait_for(fetch_rest(closing), timeout=20)
        finally:
            await pub.close()
            await fetcher.close()
            await server.stop()

    async def fetch_rest(it: AsyncIterator[list[tuple[str, torch.Tensor]]]) -> None:
        [_ async for _ in it]

    run(main())
