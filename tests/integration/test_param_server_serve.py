"""The param server as a real Ray Serve application: the object_store transport through its
deployment handle, grpc through Serve's gRPC proxy (client streaming) and the replica's data
plane."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from meshrl.v1 import common_pb2
from services.common.config import MeshConfig
from services.param_server.deployment import APP_NAME, DEPLOYMENT_NAME, build_app
from services.weights.client import ParamServerClient
from services.weights.transports.grpc import GrpcFetcher, GrpcPublisher
from services.weights.transports.object_store import ObjectStoreFetcher, ObjectStorePublisher, ServeDirectory


def buckets(seed: int) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [("model.embed_tokens.weight", torch.randn(500, 64, generator=g).bfloat16()),
         ("model.norm.weight", torch.randn(64, generator=g))],
        [("lm_head.weight", torch.randn(400, 64, generator=g)), ("flag", torch.tensor(False))],
    ]


def same(got: dict[str, torch.Tensor], seed: int) -> bool:
    want = {n: t for b in buckets(seed) for n, t in b}
    return set(got) == set(want) and all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in want.items())


@pytest.fixture(scope="module")
def serve_app(serve_grpc_port: int) -> Iterator[int]:
    """The param server app on the session's Serve (shared fixture), removed afterwards."""
    from ray import serve

    cfg = MeshConfig.model_validate({"param_server": {"port": 0, "retain_versions": 1}})
    serve.run(build_app({"config": cfg.model_dump(mode="json")}), name=APP_NAME, route_prefix="/param_server")
    try:
        yield serve_grpc_port
    finally:
        serve.delete(APP_NAME)


@pytest.fixture
def ray_worker_fetch():  # type: ignore[no-untyped-def]
    import ray

    @ray.remote(num_cpus=0)
    def fetch_in_worker(version: int) -> tuple[bool, int]:
        from services.weights.transports.object_store import ObjectStoreFetcher, ServeDirectory

        async def main() -> tuple[bool, int]:
            f = ObjectStoreFetcher(ServeDirectory.from_app(), consumer_id="worker", verify="always")
            got = {}
            async for bucket in f.fetch(common_pb2.WeightsRef(policy_version=version)):
                got.update({n: t.clone() for n, t in bucket})
            await f.close()  # its release has landed before this loop ends
            return same(got, version), f.verified_buckets

        return asyncio.run(main())

    return fetch_in_worker


def test_object_store_round_trip_through_the_deployment(serve_app: int, ray_worker_fetch) -> None:  # type: ignore[no-untyped-def]
    import ray

    async def main() -> None:
        directory = ServeDirectory.from_app()
        pub = ObjectStorePublisher(directory)
        ref = await pub.publish(1, buckets(1))
        fetcher = ObjectStoreFetcher(directory, consumer_id="driver")
        got: dict[str, torch.Tensor] = {}
        async for bucket in fetcher.fetch(ref):
            got.update({n: t.clone() for n, t in bucket})
        assert same(got, 1)
        assert fetcher.verified_buckets == 0  # same node: mapped, not transferred, so not re-hashed
        ok, verified = await ray_worker_fetch.remote(1)
        assert ok and verified == 2  # another process, verify="always": every bucket fingerprinted
        # retain_versions=1: version 1's objects are released; version 2's two buckets are put at
        # once (what a host with >= 8 CPUs does), read back whole below
        await ObjectStorePublisher(directory, puts_in_flight=2).publish(2, buckets(2))
        handle = directory.handle
        with pytest.raises(Exception, match="not held"):
            await handle.object_store_version.remote(1, "driver")
        newest = common_pb2.WeightsRef(policy_version=-1)
        got = {}
        async for bucket in fetcher.fetch(newest):
            got.update({n: t.clone() for n, t in bucket})
        assert same(got, 2)

    asyncio.run(main())
    assert ray.is_initialized()


def test_grpc_through_the_serve_proxy_and_the_data_plane(serve_app: int) -> None:
    from ray import serve

    async def main() -> None:
        handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP_NAME)
        data_address = await handle.data_address.remote()
        proxy = f"127.0.0.1:{serve_app}"
        # client streaming through Serve's proxy (every message crosses an actor hop)
        pub = GrpcPublisher(proxy, application=APP_NAME, chunk_bytes=32 * 1024)
        ref = await pub.publish(10, buckets(10))
        async with ParamServerClient(proxy, application=APP_NAME) as client:
            assert (await client.get_manifest(10)).checksum == ref.manifest_checksum
            assert [v.policy_version for v in await client.list_versions()] == [10]
        # bulk bytes from the replica's own data plane
        fetcher = GrpcFetcher(consumer_id="rollout-0")
        ref.param_server_address = data_address
        got: dict[str, torch.Tensor] = {}
        async for bucket in fetcher.fetch(ref):
            got.update({n: t.clone() for n, t in bucket})
        assert same(got, 10)
        # and the standard FetchWeights through the proxy too
        via_proxy = GrpcFetcher(proxy, consumer_id="rollout-1", application=APP_NAME)
        ref.param_server_address = ""
        got = {}
        async for bucket in via_proxy.fetch(ref):
            got.update({n: t.clone() for n, t in bucket})
        assert same(got, 10)
        for c in (pub, fetcher, via_proxy):
            await c.close()

    asyncio.run(main())


def test_object_store_frees_a_version_once_retention_evicts_it(serve_app: int) -> None:
    """retain_versions=1: publishing the next version releases the previous one's objects (one per
    bucket), so the store can reuse their memory; nothing else keeps them pinned. Runs after the
    cases above: versions 30-31 are newer than theirs."""
    import time

    import ray

    def owned() -> set[str]:
        counts = ray._private.worker.global_worker.core_worker.get_all_reference_counts()
        return {k.decode() if isinstance(k, bytes) else str(k) for k in counts}  # keys: hex ids, as bytes

    async def main() -> None:
        directory = ServeDirectory.from_app()
        pub = ObjectStorePublisher(directory)
        await pub.publish(30, buckets(30))
        _, refs = await directory.lookup(30, "probe")
        assert [len(r) for r in refs] == [1, 1]  # one object per bucket
        ids = {r.hex() for bucket in refs for r in bucket}
        del refs
        await directory.release(30, "probe")
        assert ids <= owned()  # retained: the param server still borrows them
        await pub.publish(31, buckets(31))  # evicts version 30
        deadline = time.monotonic() + 60
        while ids & owned():
            assert time.monotonic() < deadline, f"version 30's objects still referenced: {ids & owned()}"
            await asyncio.sleep(0.05)
        fetcher = ObjectStoreFetcher(directory, consumer_id="driver")
        got = {n: t.clone() async for b in fetcher.fetch(common_pb2.WeightsRef(policy_version=31)) for n, t in b}
        assert same(got, 31)

    asyncio.run(main())


def test_a_ranks_export_is_registered_as_the_objects_it_crossed_in(serve_app: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real path of an FSDP trainer: rank 0 (a Ray actor on this node) exports packed buckets,
    RayTrainGroup reads them from the object store, and the object_store publisher registers those
    very objects (owned by this process) instead of writing the bytes again. Readers get the
    weights whole; they outlive the rank; a reader on this node is not made to fingerprint them."""
    from services.trainer.workers import RayTrainGroup
    from services.weights.packing import PackedBucket
    from services.weights.transports import object_store as osx
    from tests.unit.fsdp_helpers import make_spec

    puts: list[int] = []
    real = osx._put_bucket
    monkeypatch.setattr(osx, "_put_bucket", lambda ray, arrays: (puts.append(len(arrays)), real(ray, arrays))[1])

    async def main() -> None:
        directory = ServeDirectory.from_app()
        group = await RayTrainGroup.create(make_spec(), 1, backend="fsdp", num_cpus=0.01)
        try:
            exported = [b async for b in group.export_weights(64 * 1024)]
            assert len(exported) > 1 and all(isinstance(b, PackedBucket) and b.stored is not None for b in exported)
            want = {n: t.clone() for b in exported for n, t in b}
            count = len(exported)
            del exported
            ref = await ObjectStorePublisher(directory).publish(1000, group.export_weights(64 * 1024))  # newest in the module
        finally:
            await group.close()  # the rank is gone: its objects belong to this process
        assert puts == []  # every bucket registered as it crossed
        fetcher = ObjectStoreFetcher(directory, consumer_id="driver")
        got: dict[str, torch.Tensor] = {}
        async for bucket in fetcher.fetch(ref):
            got.update({n: t.clone() for n, t in bucket})
        assert fetcher.verified_buckets == 0  # on the node that wrote them
        checked = ObjectStoreFetcher(directory, consumer_id="checker", verify="always")
        async for bucket in checked.fetch(ref):
            assert all(torch.equal(t, want[n]) for n, t in bucket)
        assert checked.verified_buckets == count  # verify="always": each fingerprint (the rank's) holds
        await fetcher.close()
        await checked.close()
        assert set(got) == set(want) and all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in want.items())

    asyncio.run(main())


def test_object_store_versions_live_in_the_object_refs_actor_and_survive_its_loss(serve_app: int) -> None:
    """The refs live in a plain actor the replica hands out (object_refs.py): a lookup takes no
    hold, the replica's store gets the manifest behind the registration (ListVersions), and when
    the actor dies the replica makes a new one: its versions are gone, the next publish goes
    through. Runs after the cases above: versions 2000+ are the newest."""
    import ray
    from ray import serve

    async def main() -> None:
        directory = ServeDirectory.from_app()
        pub = ObjectStorePublisher(directory)
        ref = await pub.publish(2000, buckets(2000))
        await pub.close()  # the manifest has reached the replica's store
        handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP_NAME)
        async with ParamServerClient(await handle.data_address.remote()) as client:
            assert (await client.get_manifest(2000)).checksum == ref.manifest_checksum
        fetcher = ObjectStoreFetcher(directory, consumer_id="driver")
        got = {n: t.clone() async for b in fetcher.fetch(ref) for n, t in b}
        assert same(got, 2000)
        actor = await handle.object_refs.remote()
        assert (await actor.stats.remote())["versions"] == [2000]
        ray.kill(actor)
        # ray.kill only asks: a call made at once may still be answered. Wait until the actor is gone.
        for _ in range(200):
            try:
                await actor.stats.remote()
            except ray.exceptions.RayActorError:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the killed object_refs actor still answers after 10 s")
        with pytest.raises(Exception, match=r"not held|no version"):
            await anext(fetcher.fetch(ref))  # the version died with the actor
        ref2 = await pub.publish(2001, buckets(2001))  # into the replica's new actor
        got = {n: t.clone() async for b in fetcher.fetch(ref2) for n, t in b}
        assert same(got, 2001)
        assert (await (await handle.object_refs.remote()).stats.remote())["versions"] == [2001]
        await pub.close()
        await fetcher.close()

    asyncio.run(main())
