"""The object_store versions' table (services/param_server/object_refs.py) and the directory that
talks to it (ServeDirectory), without Ray: retention, immutability once seen, refusals that
change nothing, a dead actor asked for again, and the board behind the registration."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.param_server.object_refs import ObjectRefsActor, RefTable
from services.weights.transports import object_store as osx


def manifest(version: int, buckets: int = 2, checksum: str = "c0ffee") -> bytes:
    m = pb.Manifest(policy_version=version, checksum=f"{checksum}{version}")
    for i in range(buckets):
        m.buckets.add(index=i, nbytes=8)
    return m.SerializeToString()


def refs(version: int, buckets: int = 2) -> list[list[str]]:
    return [[f"v{version}b{i}"] for i in range(buckets)]


def test_the_newest_retained_versions_are_kept_and_older_refs_dropped_at_registration() -> None:
    t = RefTable(retain=2)
    for v in (1, 2, 3):
        assert t.register(manifest(v), refs(v)) == v
    assert sorted(t.versions) == [2, 3] and t.dropped_total == 1  # version 1's refs went with 3's registration
    raw, got = t.lookup(-1)
    assert pb.Manifest.FromString(raw).policy_version == 3 and got == refs(3)
    assert t.lookup(2)[1] == refs(2)
    with pytest.raises(NotFound, match=r"version 1 is not held \(held: \[2, 3\]\)"):
        t.lookup(1)
    with pytest.raises(NotFound, match="no version has been published yet"):
        RefTable(retain=1).lookup(-1)


@pytest.mark.parametrize(("raw", "bucket_refs", "field"), [
    (b"\xff\xff not a manifest", refs(1), "manifest"),
    (manifest(-1), refs(1), "manifest.policy_version"),
    (pb.Manifest(policy_version=4).SerializeToString(), [], "manifest.checksum"),
    (manifest(4, buckets=2), refs(4, buckets=3), "refs"),
    (manifest(4), "not a list", "refs"),
])
def test_a_refused_registration_names_its_field_and_changes_nothing(raw: bytes, bucket_refs: Any, field: str) -> None:
    t = RefTable(retain=1)
    t.register(manifest(3), refs(3))
    with pytest.raises(InvalidArgument, match=f"^{field.replace('.', '[.]')}: "):
        t.register(raw, bucket_refs)
    assert sorted(t.versions) == [3] and t.lookup(3)[1] == refs(3) and t.registered_total == 1


def test_a_version_is_immutable_once_looked_up_and_replaceable_before() -> None:
    t = RefTable(retain=2)
    t.register(manifest(5), refs(5))
    t.register(manifest(5, checksum="other"), [["new0"], ["new1"]])  # an orphan nobody saw: replaced
    assert t.lookup(5)[1] == [["new0"], ["new1"]]
    with pytest.raises(FailedPrecondition, match="already published with different content"):
        t.register(manifest(5, checksum="third"), refs(5))
    assert t.lookup(5)[1] == [["new0"], ["new1"]]
    t.register(manifest(5, checksum="other"), [["again0"], ["again1"]])  # same content: its refs renewed
    with pytest.raises(FailedPrecondition, match="consumers have seen it"):
        t.register(manifest(5, checksum="third"), refs(5))  # still seen after the renewal
    assert t.lookup(5)[1] == [["again0"], ["again1"]]
    t.register(manifest(6), refs(6))
    with pytest.raises(FailedPrecondition, match="older than the 2 retained"):
        t.register(manifest(4), refs(4))  # would be dropped at once
    with pytest.raises(InvalidArgument, match="retain_versions"):
        RefTable(retain=0)


def test_the_actor_wraps_the_table() -> None:
    a = ObjectRefsActor(1)
    a.register(manifest(1), refs(1))
    a.register(manifest(2), refs(2))
    assert a.lookup(-1)[1] == refs(2)
    assert a.stats() == {"versions": [2], "registered_total": 2, "dropped_total": 1}


class DeadActor(Exception):
    """What a call on a dead actor raises (stands in for Ray's RayActorError)."""


class FakeMethod:
    """`.remote(*args)` of a handle: an awaitable of `fn(*args)` (awaited as is when `fn` is async)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            out = self.fn(*args)
            return await out if asyncio.iscoroutine(out) else out
        return call()


class FakeActor:
    """The ObjectRefsActor behind `.method.remote()` calls; `dead` makes every call raise."""

    def __init__(self) -> None:
        self.inner = ObjectRefsActor(1)
        self.dead = False

    def __getattr__(self, name: str) -> FakeMethod:
        method = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            if self.dead:
                raise DeadActor("the actor died")
            return method(*args)
        return FakeMethod(call)


class FakeHandle:
    """The param server replica's handle: object_refs() (a new actor after a death) and the board."""

    def __init__(self) -> None:
        self.actors = [FakeActor()]
        self.board: list[int] = []
        self.board_gate = asyncio.Event()
        self.board_error: Exception | None = None
        self.object_refs = FakeMethod(self._object_refs)
        self.register_object_store_version = FakeMethod(self._board)

    def _object_refs(self) -> FakeActor:
        if self.actors[-1].dead:
            self.actors.append(FakeActor())
        return self.actors[-1]

    async def _board(self, raw: bytes) -> None:
        await self.board_gate.wait()
        if self.board_error is not None:
            raise self.board_error
        self.board.append(pb.Manifest.FromString(raw).policy_version)


@pytest.fixture
def fake_exceptions(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    exc = types.SimpleNamespace(RayActorError=DeadActor, ActorUnavailableError=DeadActor)
    monkeypatch.setattr(osx, "_ray", lambda: types.SimpleNamespace(exceptions=exc))


def test_the_directory_registers_at_the_actor_and_posts_the_board_behind_it(fake_exceptions: None) -> None:
    handle = FakeHandle()
    d = osx.ServeDirectory(handle)

    async def main() -> None:
        await d.register(pb.Manifest.FromString(manifest(1)), refs(1))  # returns with the board still gated
        assert handle.board == []
        m, got = await d.lookup(1, "rollout-0")
        assert m.policy_version == 1 and got == refs(1)  # the actor answers; the board is not needed
        await d.release(1, "rollout-0")  # no hold was taken: nothing to send
        handle.board_gate.set()
        await d.register(pb.Manifest.FromString(manifest(2)), refs(2))  # waits for 1's board first
        assert handle.board == [1]
        await d.settle()
        assert handle.board == [1, 2]
        handle.board_error = RuntimeError("replica restarting")
        await d.register(pb.Manifest.FromString(manifest(3)), refs(3))
        await d.settle()  # a failed board is logged and counted, not raised: fetches have the version
        assert d.board_failures == 1 and (await d.lookup(3, "r"))[1] == refs(3)

    asyncio.run(main())


def test_a_board_post_that_never_answers_fails_after_its_bound_and_holds_nothing_up(fake_exceptions: None) -> None:
    """A replica that hung on the board call held the next registration (which waits for the
    last post) until the publish's deadline failed it, and the publisher's close forever."""
    handle = FakeHandle()  # the board gate is never opened: the replica does not answer
    d = osx.ServeDirectory(handle, board_timeout_s=0.05)

    async def main() -> None:
        await d.register(pb.Manifest.FromString(manifest(1)), refs(1))
        await asyncio.wait_for(d.register(pb.Manifest.FromString(manifest(2)), refs(2)), timeout=5)
        await asyncio.wait_for(d.settle(), timeout=5)
        assert d.board_failures == 2 and handle.board == []
        assert (await d.lookup(2, "r"))[1] == refs(2)  # fetches never needed the board

    asyncio.run(main())


def test_a_dead_actor_is_asked_for_again_once_and_its_versions_are_gone(fake_exceptions: None) -> None:
    handle = FakeHandle()
    handle.board_gate.set()
    d = osx.ServeDirectory(handle)

    async def main() -> None:
        await d.register(pb.Manifest.FromString(manifest(1)), refs(1))
        handle.actors[0].dead = True
        with pytest.raises(NotFound, match="no version"):
            await d.lookup(-1, "r")  # the new actor holds nothing: version 1 died with the old one
        await d.register(pb.Manifest.FromString(manifest(2)), refs(2))
        assert len(handle.actors) == 2 and (await d.lookup(2, "r"))[1] == refs(2)
        await d.settle()

    asyncio.run(main())


def test_an_object_refs_actor_the_replica_gives_up_on_is_killed_so_no_client_keeps_using_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replica replaced an object_refs actor that did not answer its probe (unreachable for a
    moment, or slower than the bound) but left it alive: a trainer whose directory still held the
    old handle went on registering there while consumers that asked anew looked up in the new,
    empty one (NotFound for every version, for good). Killed, every old handle's next call fails
    and its directory asks the replica again, landing on the new actor."""
    import types

    import ray

    from services.param_server import object_refs
    from services.param_server.deployment import ParamServerDeployment

    class Unreachable:
        def __init__(self) -> None:
            self.stats = FakeMethod(self._stats)

        def _stats(self) -> None:
            raise ray.exceptions.ActorUnavailableError("the actor is unreachable for now", None)

    old, new, killed = Unreachable(), FakeActor(), []
    monkeypatch.setattr(object_refs, "start", lambda retain: new)
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: killed.append(actor))
    replica = types.SimpleNamespace(_refs=old, _retain=1, _refs_lock=asyncio.Lock())
    got = asyncio.run(ParamServerDeployment.func_or_class.object_refs(replica))
    assert got is new and replica._refs is new
    assert killed == [old]  # its holders' next call fails: they ask again and find the new actor


class CallsNow:
    """An actor handle whose `.method.remote(*args)` runs the call at once (a fire-and-forget call
    the replica does not await has landed before anything else reaches the actor)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        import types

        return types.SimpleNamespace(remote=getattr(self.inner, name))


def test_a_version_a_consumer_saw_through_the_store_is_immutable_in_the_object_refs_actor_too() -> None:
    """AcquireVersion (and GetManifest, before it stopped marking versions seen) of an object_store
    version marked it seen in the replica's store only: the object_refs actor, where its content
    lives, took it for unseen and let a republish with other content swap its refs; the store then
    refused that board post (logged only), so the manifest the consumer got and the objects every
    fetch gets disagreed for good."""
    import dataclasses
    import types

    from services.param_server.deployment import ParamServerDeployment
    from services.param_server.store import StoreSettings, WeightStore
    from services.weights import convert
    from tests.unit.test_param_server_store import make_version

    def raw(seed: int) -> bytes:
        m = dataclasses.replace(make_version(5, seed=seed)[0], transports=("object_store",))
        return convert.manifest_to_proto(m).SerializeToString()  # type: ignore[no-any-return]

    a, b = raw(0), raw(1)
    store = WeightStore(StoreSettings(retain_versions=2))
    actor = ObjectRefsActor(2)
    replica = types.SimpleNamespace(_servicer=types.SimpleNamespace(store=store), _refs=CallsNow(actor))
    deployment = ParamServerDeployment.func_or_class
    store.on_served = lambda stored: deployment._store_served(replica, stored)  # as the replica's __init__ wires it
    actor.register(a, [["a0"], ["a1"]])  # the trainer's publish: the actor, then the board behind it
    asyncio.run(deployment.register_object_store_version(replica, a))
    seen = store.acquire("rollout-0", 5, 1.0)  # a consumer's AcquireVersion
    with pytest.raises(FailedPrecondition, match="consumers have seen it"):
        actor.register(b, [["b0"], ["b1"]])  # a republish with other content
    assert actor.table.lookup(5) == (a, [["a0"], ["a1"]]) and store.get(5).manifest.checksum == seen.checksum
    # other content than the actor holds (a republish that got there first): the actor is left as it is
    t = RefTable(retain=1)
    t.register(manifest(7), refs(7))
    assert not t.seen(7, "another checksum") and not t.seen(8, "c0ffee8") and not t.versions[7].served
    assert t.seen(7, "c0ffee7") and t.versions[7].served
