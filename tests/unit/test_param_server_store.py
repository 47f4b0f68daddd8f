"""The versioned store (uploads, visibility, holds, retention) and the rendezvous board."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from services.param_server.rendezvous import RendezvousBoard
from services.param_server.store import StoreSettings, WeightStore
from services.weights.layout import (
    BucketMeta,
    Manifest,
    build_manifest,
    fingerprint_tensor,
    pack_into,
    plan_bucket,
)


def make_version(version: int, seed: int = 0, sizes: tuple[int, ...] = (1000, 10)) -> tuple[Manifest, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 1000 + version)
    tensors, buckets, buffers = [], [], []
    for i, n in enumerate(sizes):
        named = [(f"layer{i}.weight", torch.randn(n, generator=g).bfloat16()), (f"layer{i}.bias", torch.randn(3, generator=g))]
        metas, nbytes = plan_bucket(i, named)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        pack_into(buf, named, metas)
        tensors += metas
        buckets.append(BucketMeta(i, nbytes, fingerprint_tensor(buf, nbytes)))
        buffers.append(buf)
    return build_manifest(version, tensors, buckets, transports=["grpc"]), buffers


def upload(store: WeightStore, m: Manifest, buffers: list[torch.Tensor], now: float, *, manifest_first: bool,
           chunk: int = 333, corrupt: tuple[int, int] | None = None) -> Manifest:
    up = store.begin_upload(m.policy_version, now)
    if manifest_first:
        up.set_manifest(m)
    for b, buf in zip(m.buckets, buffers, strict=True):
        if not manifest_first:
            up.begin_bucket(b)
        for off in range(0, b.nbytes, chunk):
            data = bytearray(buf[off : off + chunk].numpy().tobytes())
            if corrupt == (b.index, off):
                data[0] ^= 0xFF
            target = up.check_chunk(b.index, off, len(data))
            up.write(target, off, data)
    if not manifest_first:
        up.set_manifest(m)
    return up.finish(now)


@pytest.mark.parametrize("manifest_first", [True, False])
def test_a_version_is_visible_only_when_complete_and_bytes_match(manifest_first: bool) -> None:
    store = WeightStore(StoreSettings(retain_versions=2))
    m, buffers = make_version(1)
    up = store.begin_upload(1, 0.0)
    up.set_manifest(m) if manifest_first else up.begin_bucket(m.buckets[0])
    target = up.check_chunk(0, 0, 10)
    up.write(target, 0, buffers[0][:10].numpy().tobytes())
    with pytest.raises(NotFound, match="still being published"):
        store.manifest(1)
    up.abort()
    stored = upload(store, m, buffers, 1.0, manifest_first=manifest_first)
    assert stored.checksum == m.checksum and store.manifest(-1).policy_version == 1
    with store.reading(1) as s:
        assert s.buffers is not None
        assert all(torch.equal(a, b) for a, b in zip(s.buffers, buffers, strict=True))


def test_a_corrupted_chunk_fails_the_upload_and_nothing_becomes_visible() -> None:
    store = WeightStore(StoreSettings())
    m, buffers = make_version(1)
    with pytest.raises(DataLoss, match="bucket 0"):
        upload(store, m, buffers, 0.0, manifest_first=False, corrupt=(0, 333))
    with pytest.raises(NotFound):
        store.manifest(1)


def test_chunks_out_of_place_are_rejected_with_the_field() -> None:
    store = WeightStore(StoreSettings())
    m, _ = make_version(1)
    up = store.begin_upload(1, 0.0)
    up.set_manifest(m)
    with pytest.raises(InvalidArgument, match=r"chunk\.offset"):
        up.check_chunk(0, 8, 4)
    with pytest.raises(Unavailable, match="another stream"):
        store.begin_upload(1, 1.0)
    store.begin_upload(1, 1000.0)  # a stalled upload is replaced ...
    with pytest.raises(DeadlineExceeded, match="dropped"):
        up.check_chunk(0, 0, 4)  # ... and its stream, should it wake up, cannot write any more


def test_a_publish_refused_for_an_upload_slot_still_taken_is_retried_by_the_trainer() -> None:
    """The trainer republishes a version after a transient failure (TrainerLoop._republish) and
    fails its loop on anything else. An upload of that number the server has not let go yet (the
    stream given up on, whose cancellation has not reached the server) refused the republish as
    FAILED_PRECONDITION, and a stream the sweeper dropped for stalling (mid-write: its copy ran
    past stall_timeout_s) was told the same on its next chunk: the trainer's loop failed, where
    waiting for the slot (stall_timeout_s) or sending again (as the servicer's own stall answer,
    DEADLINE_EXCEEDED, makes it) was all it took."""
    from services.common.errors import transient

    store = WeightStore(StoreSettings(stall_timeout_s=60.0))
    m, buffers = make_version(3)
    given_up = store.begin_upload(3, 0.0)
    given_up.set_manifest(m)
    with pytest.raises(MeshError, match="another stream") as info:
        store.begin_upload(3, 1.0)
    assert transient(info.value), repr(info.value)
    given_up.abort()  # its cancellation reaches the server
    assert upload(store, m, buffers, 2.0, manifest_first=True).checksum == m.checksum

    stalled = store.begin_upload(4, 0.0)
    stalled.set_manifest(make_version(4)[0])
    for upload_ in store.stalled_uploads(61.0):
        upload_.abort()  # the sweeper
    with pytest.raises(MeshError, match="was dropped") as info:
        stalled.check_chunk(0, 0, 4)
    assert transient(info.value), repr(info.value)


def test_versions_are_immutable_but_republishing_the_same_content_is_idempotent() -> None:
    store = WeightStore(StoreSettings())
    m, buffers = make_version(1)
    upload(store, m, buffers, 0.0, manifest_first=True)
    upload(store, m, buffers, 1.0, manifest_first=False)
    store.acquire("rollout-0", 1, 1.5)  # a consumer holds it
    other, other_buffers = make_version(1, seed=9)
    with pytest.raises(FailedPrecondition, match="immutable once seen"):
        upload(store, other, other_buffers, 2.0, manifest_first=True)
    assert store.manifest(1).checksum == m.checksum


@pytest.mark.parametrize("seen_by", ["hold", "bytes"])
def test_a_version_no_consumer_has_seen_is_replaced_by_the_resumed_trainer(seen_by: str) -> None:
    """A trainer that died between publish and commit leaves an orphan; its successor resumes
    from a checkpoint and publishes the same number with other weights. Until a consumer has
    loaded the orphan (a hold or its bytes) it is replaced; after, it is immutable."""
    store = WeightStore(StoreSettings())
    orphan, orphan_buffers = make_version(18)
    upload(store, orphan, orphan_buffers, 0.0, manifest_first=True)
    resumed, resumed_buffers = make_version(18, seed=9)
    assert resumed.checksum != orphan.checksum
    upload(store, resumed, resumed_buffers, 1.0, manifest_first=True)
    assert store.manifest(18).checksum == resumed.checksum  # (seen from here on)
    assert [s.policy_version for s in store.versions()] == [18]

    fresh = WeightStore(StoreSettings())
    upload(fresh, orphan, orphan_buffers, 0.0, manifest_first=True)
    if seen_by == "hold":
        fresh.acquire("rollout-0", 18, 0.5)
    else:
        with fresh.reading(18) as stored:
            assert stored.buffers is not None
    with pytest.raises(FailedPrecondition, match="immutable once seen"):
        upload(fresh, resumed, resumed_buffers, 1.0, manifest_first=True)
    with fresh.reading(18) as stored:
        assert stored.manifest.checksum == orphan.checksum


def test_a_manifest_asked_for_as_the_newest_does_not_make_the_orphan_immutable() -> None:
    """GetManifest(-1) (WeightsClient.newest_ref, a status probe) answers whatever was published
    last, committed or not: it marked an orphan seen, and the resumed trainer's republish of its
    number was refused as immutable, a non-transient error, so the trainer restarted into the same
    refusal for good. A load of the newest (a hold: AcquireVersion(-1)) still makes it immutable."""
    store = WeightStore(StoreSettings())
    orphan, orphan_buffers = make_version(18)
    upload(store, make_version(17)[0], make_version(17)[1], 0.0, manifest_first=True)
    upload(store, orphan, orphan_buffers, 0.0, manifest_first=True)
    assert store.manifest(-1).checksum == orphan.checksum
    resumed, resumed_buffers = make_version(18, seed=9)
    upload(store, resumed, resumed_buffers, 1.0, manifest_first=True)
    assert store.manifest(18).checksum == resumed.checksum

    fresh = WeightStore(StoreSettings())
    upload(fresh, orphan, orphan_buffers, 0.0, manifest_first=True)
    assert fresh.acquire("rollout-0", -1, 0.5).checksum == orphan.checksum
    with pytest.raises(FailedPrecondition, match="immutable once seen"):
        upload(fresh, resumed, resumed_buffers, 1.0, manifest_first=True)


def test_a_manifest_asked_for_by_number_does_not_make_the_orphan_immutable() -> None:
    """GetManifest(18) (ListVersions then GetManifest from a dashboard, grpcurl, the weights
    bench) of an uncommitted orphan marked it seen, as 7d8f14f stopped for GetManifest(-1) only:
    the resumed trainer's republish of 18 was refused as immutable, a non-transient error, and the
    coordinator takes no other number (CommitVersion wants committed + 1), so every restart of the
    trainer failed the same way. A manifest hands out no weights; the fetch that would checks the
    checksum (check_against_manifest). A hold of the version still makes it immutable."""
    store = WeightStore(StoreSettings())
    orphan, orphan_buffers = make_version(18)
    upload(store, orphan, orphan_buffers, 0.0, manifest_first=True)
    assert store.manifest(18).checksum == orphan.checksum
    resumed, resumed_buffers = make_version(18, seed=9)
    upload(store, resumed, resumed_buffers, 1.0, manifest_first=True)
    assert store.manifest(18).checksum == resumed.checksum
    store.acquire("rollout-0", 18, 2.0)
    with pytest.raises(FailedPrecondition, match="immutable once seen"):
        upload(store, orphan, orphan_buffers, 3.0, manifest_first=True)


@pytest.mark.parametrize("bad", [{"bucket_indices": [7]}, {"names": ["no.such.weight"]}])
def test_a_refused_fetch_does_not_count_as_seen_and_the_orphan_stays_replaceable(bad: dict) -> None:
    """FetchWeights pinned (and marked seen) the version before checking bucket_indices / names:
    a request refused with INVALID_ARGUMENT, which never got the manifest or a byte, made an
    orphan immutable, and the resumed trainer's republish of its number failed for good."""
    import asyncio

    from meshrl.v1 import param_server_pb2 as pb
    from services.param_server.servicer import ParamServerServicer

    store = WeightStore(StoreSettings())
    orphan, orphan_buffers = make_version(18)
    upload(store, orphan, orphan_buffers, 0.0, manifest_first=True)
    servicer = ParamServerServicer(store, clock=lambda: 1.0)

    async def fetch() -> None:
        async for _ in servicer.fetch_items(pb.FetchWeightsRequest(policy_version=18, **bad)):
            pass

    with pytest.raises(InvalidArgument):
        asyncio.run(fetch())
    assert store.get(18).readers == 0 and not store.get(18).served
    resumed, resumed_buffers = make_version(18, seed=9)
    upload(store, resumed, resumed_buffers, 2.0, manifest_first=True)
    assert store.manifest(18).checksum == resumed.checksum


def test_registered_versions_carry_no_bytes_and_merge_with_a_grpc_upload() -> None:
    store = WeightStore(StoreSettings())
    m, buffers = make_version(4)
    with pytest.raises(InvalidArgument, match="transports"):
        store.register(m, 0.0)
    store.register(m.with_transports(["nccl"]).__class__(**{**m.__dict__, "transports": ("nccl",)}), 0.0)
    with pytest.raises(FailedPrecondition, match="does not hold its bytes"), store.reading(4):
        pass
    upload(store, m, buffers, 1.0, manifest_first=True)
    assert set(store.manifest(4).transports) == {"nccl", "grpc"}
    with store.reading(4) as s:
        assert s.buffers is not None


def test_holds_pin_versions_until_released_or_expired() -> None:
    store = WeightStore(StoreSettings(retain_versions=1, hold_ttl_s=100.0))
    for v in (1, 2):
        upload(store, *make_version(v), float(v), manifest_first=True)
    assert [s.policy_version for s in store.versions()] == [2]
    upload(store, *make_version(3), 3.0, manifest_first=True)
    store.acquire("rollout-0", 3, 3.0)
    upload(store, *make_version(4), 4.0, manifest_first=True)
    assert [s.policy_version for s in store.versions()] == [3, 4]
    store.sweep(50.0)
    assert [s.policy_version for s in store.versions()] == [3, 4]
    store.sweep(200.0)  # the hold expired (not renewed)
    assert [s.policy_version for s in store.versions()] == [4]
    with pytest.raises(NotFound, match="evicted"):
        store.acquire("rollout-0", 3, 200.0)


def test_evicted_buffers_are_reused_for_the_next_upload() -> None:
    store = WeightStore(StoreSettings(retain_versions=1))
    upload(store, *make_version(1), 0.0, manifest_first=True)
    m2, b2 = make_version(2)
    upload(store, m2, b2, 1.0, manifest_first=True)
    assert store.pool.pooled_bytes > 0
    pooled = {t.data_ptr() for t in store.pool._free}
    upload(store, *make_version(3), 2.0, manifest_first=True)
    with store.reading(3) as s:
        assert s.buffers is not None and {b.data_ptr() for b in s.buffers} & pooled


ops = st.lists(
    st.one_of(
        st.tuples(st.just("publish")),
        st.tuples(st.just("acquire"), st.integers(0, 3), st.integers(0, 12)),
        st.tuples(st.just("release"), st.integers(0, 3), st.integers(0, 12)),
        st.tuples(st.just("open"), st.integers(0, 12)),
        st.tuples(st.just("close")),
        st.tuples(st.just("time"), st.floats(0, 40)),
    ),
    max_size=40,
)


def test_a_stalled_upload_dropped_mid_write_keeps_its_buffer_from_the_next_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweeper dropped a stalled upload while the io thread still copied a chunk into its
    buffer: the buffer went back to the pool, the next upload of that size took it, and the late
    copy landed over bytes already fingerprinted as they arrived. The version was published, and
    served, with another upload's bytes. A buffer being written stays out of the pool."""
    import asyncio
    import threading

    from meshrl.v1 import param_server_pb2 as pb
    from services.common.grpc_util import LocalContext
    from services.param_server import store as store_mod
    from services.param_server.servicer import ParamServerServicer
    from services.weights import convert
    from services.weights.wire import RawChunk

    now = [0.0]
    store = WeightStore(StoreSettings(stall_timeout_s=1.0, retain_versions=4))
    servicer = ParamServerServicer(store, clock=lambda: now[0], stall_timeout_s=60.0)
    release_a, a_writing = threading.Event(), threading.Event()
    real_write = store_mod.Upload.write

    def slow_first_write(bucket: object, offset: int, data: object) -> None:
        if not a_writing.is_set():  # upload A's chunk: a slow copy in the io thread
            a_writing.set()
            release_a.wait(10)
        real_write(bucket, offset, data)  # type: ignore[arg-type]

    monkeypatch.setattr(store_mod.Upload, "write", staticmethod(slow_first_write))
    ma, ba = make_version(2, seed=1, sizes=(4000,))
    mb, bb = make_version(3, seed=2, sizes=(4000,))

    async def requests(m: Manifest, buffers: list[torch.Tensor], hang: asyncio.Event | None = None) -> object:
        for b, buf in zip(m.buckets, buffers, strict=True):
            yield pb.PublishWeightsRequest(bucket=convert.bucket_to_proto(b))
            yield RawChunk(m.policy_version, b.index, 0, memoryview(buf.numpy().tobytes()))
        if hang is not None:
            await hang.wait()
        yield pb.PublishWeightsRequest(manifest=convert.manifest_to_proto(m))

    async def main() -> None:
        hang = asyncio.Event()
        a = asyncio.ensure_future(servicer.PublishWeights(requests(ma, ba, hang), LocalContext()))
        while not a_writing.is_set():
            await asyncio.sleep(0.01)
        now[0] += 2.0  # no progress for stall_timeout_s: the sweeper drops A mid-write
        servicer.start_sweeper(interval_s=0.01)
        while store._uploads:
            await asyncio.sleep(0.01)
        await servicer.PublishWeights(requests(mb, bb), LocalContext())  # B: same size, pool first
        release_a.set()
        hang.set()
        with pytest.raises(DeadlineExceeded, match="was dropped"):
            await a
        await servicer.close()

    asyncio.run(main())
    with store.reading(3) as stored:
        assert stored.buffers is not None and torch.equal(stored.buffers[0], bb[0])


def test_a_refused_registration_leaves_the_upload_in_progress_tracked() -> None:
    """A manifest-only registration refused (the version is immutable once seen) untracked the
    grpc upload of that version still streaming: the sweeper could no longer drop it, and a
    second upload of the version was let in beside it. A refused request changes nothing."""
    store = WeightStore(StoreSettings())
    m, buffers = make_version(1)
    upload(store, m, buffers, 0.0, manifest_first=True)
    store.acquire("rollout-0", 1, 0.5)  # held: immutable
    live = store.begin_upload(1, 1.0)  # the publisher's retry of version 1, streaming
    live.set_manifest(m)
    other, _ = make_version(1, seed=9)
    with pytest.raises(FailedPrecondition, match="immutable once seen"):
        store.register(Manifest(**{**other.__dict__, "transports": ("disk",)}), 1.5)
    assert store._uploads.get(1) is live


def test_a_hold_that_expired_unswept_counts_against_the_holders_quota() -> None:
    """A consumer whose hold expired (not swept yet) skipped the max_holders_per_version check
    but counted for nothing in it: returning consumers pushed the live holders past the quota."""
    store = WeightStore(StoreSettings(max_holders_per_version=2, hold_ttl_s=10.0))
    upload(store, *make_version(1), 0.0, manifest_first=True)
    store.acquire("a", 1, 0.0)
    store.acquire("b", 1, 0.0)
    store.acquire("c", 1, 20.0)  # a's and b's holds expired; no sweep ran
    store.acquire("d", 1, 20.0)
    for late in ("a", "b"):
        with pytest.raises(ResourceExhausted, match="max_holders_per_version"):
            store.acquire(late, 1, 20.0)
    assert store.get(1).live_holders(20.0) == 2
    store.acquire("c", 1, 21.0)  # a live holder renews its hold


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(1, 3))
def test_retention_never_frees_a_version_in_use(sequence: list[tuple], keep: int) -> None:
    """Whatever the order of publishes, holds, releases, readers and time: the newest `keep`
    versions, every version with an unexpired hold and every version being read stay fetchable."""
    store = WeightStore(StoreSettings(retain_versions=keep, hold_ttl_s=30.0))
    now, next_version = 0.0, 0
    holds: dict[tuple[str, int], float] = {}
    readers: list[tuple[int, object]] = []
    published: list[int] = []
    for op in sequence:
        if op[0] == "publish":
            upload(store, *make_version(next_version, sizes=(16,)), now, manifest_first=True, chunk=64)
            published.append(next_version)
            next_version += 1
        elif op[0] == "acquire" and op[2] in [s.policy_version for s in store.versions()]:
            store.acquire(f"c{op[1]}", op[2], now)
            holds[(f"c{op[1]}", op[2])] = now + 30.0
        elif op[0] == "release":
            store.release(f"c{op[1]}", op[2], now)
            holds.pop((f"c{op[1]}", op[2]), None)
        elif op[0] == "open" and op[1] in [s.policy_version for s in store.versions()]:
            cm = store.reading(op[1])
            cm.__enter__()
            readers.append((op[1], cm))
        elif op[0] == "close" and readers:
            _, cm = readers.pop(0)
            cm.__exit__(None, None, None)  # type: ignore[attr-defined]
        elif op[0] == "time":
            now += op[1]
            store.sweep(now)
        held = {s.policy_version for s in store.versions()}
        must = set(published[-keep:])
        must |= {v for (_, v), expiry in holds.items() if expiry > now}
        must |= {v for v, _ in readers}
        assert must <= held, (must - held, op)
        for v in held:  # and every held version still has its bytes
            with store.reading(v) as s:
                assert s.buffers is not None and len(s.buffers) == 1
    for _, cm in readers:
        cm.__exit__(None, None, None)  # type: ignore[attr-defined]


# ---- rendezvous -----------------------------------------------------------------------------------


def test_rendezvous_assigns_ranks_and_holds_the_sender_until_all_receivers_check_in() -> None:
    board = RendezvousBoard()
    assert board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=1) == (None, False)
    state = board.sender_check_in("g", "s", world_size=3, backend="gloo", master_address="h", master_port=5, policy_version=1)
    assert state.generation == 1 and board.sender_ready("g", 1)[0] is False
    got, changed = board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=1)
    assert got is None and changed  # a barrier of the whole group: r2 is not in yet
    assert board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=1) == (None, False)
    assert board.sender_ready("g", 1) == (False, "1 of 2 receivers checked in for version 1 (['r1'])")
    got2, _ = board.receiver_check_in("g", "r2", backend="gloo", world_size=3, policy_version=1)
    assert got2 is not None and got2.rank == 2 and board.sender_ready("g", 1)[0]
    got, _ = board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=1)
    assert got is not None and got.rank == 1 and got.generation == 1
    with pytest.raises(ResourceExhausted, match="full"):
        board.receiver_check_in("g", "r3", backend="gloo", world_size=0, policy_version=1)
    with pytest.raises(FailedPrecondition, match="only ranks of one device kind"):
        board.receiver_check_in("g", "r1", backend="nccl", world_size=0, policy_version=1)


def test_rendezvous_moves_on_to_newer_versions_and_new_generations() -> None:
    board = RendezvousBoard()
    board.sender_check_in("g", "s", world_size=2, backend="gloo", master_address="h", master_port=5, policy_version=1)
    assert board.receiver_check_in("g", "r", backend="gloo", world_size=0, policy_version=2) == (None, True)
    board.sender_check_in("g", "s", world_size=2, backend="gloo", master_address="h", master_port=5, policy_version=2)
    assert board.sender_ready("g", 2)[0]  # the receiver was already waiting for 2
    with pytest.raises(FailedPrecondition, match="fetch the newer version"):
        board.receiver_check_in("g", "r", backend="gloo", world_size=0, policy_version=1)
    state = board.sender_check_in("g", "s", world_size=2, backend="gloo", master_address="h", master_port=6, policy_version=3)
    assert state.generation == 2 and state.ranks == {}
    got, _ = board.receiver_check_in("g", "r", backend="gloo", world_size=0, policy_version=3)
    assert got is not None and got.generation == 2 and got.master_port == 6
    with pytest.raises(InvalidArgument, match="backend"):
        board.sender_check_in("g", "s", world_size=2, backend="mpi", master_address="h", master_port=6, policy_version=4)


def test_rendezvous_a_member_that_failed_retires_the_generation_for_every_member() -> None:
    """Issue 21: a member that failed a version (and dropped its group) reports the generation at its
    next check-in; every member, the sender included, then joins a new one, on the same store."""
    board = RendezvousBoard()
    kw: dict = {"world_size": 3, "backend": "gloo", "master_address": "h", "master_port": 5}
    board.sender_check_in("g", "s", **kw, policy_version=1)
    for r in ("r1", "r2"):
        board.receiver_check_in("g", r, backend="gloo", world_size=0, policy_version=1)
    assert board.sender_ready("g", 1)[0]
    # version 2: r1 is steady (its check-in comes first), r2 failed version 1 in generation 1
    state = board.sender_check_in("g", "s", **kw, policy_version=2)
    assert board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=2)[0] is None
    got, changed = board.receiver_check_in("g", "r2", backend="gloo", world_size=0, policy_version=2, failed_generation=1)
    assert changed and got is None  # generation 2 opened: r1 must check in there too
    assert board.group("g").generation == 2 and board.sender_ready("g", 2, state) == (
        False, "1 of 2 receivers checked in for version 2 (['r2'])")
    got, _ = board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=2)
    assert got is not None and got.generation == 2 and got.master_port == 5
    assert board.sender_ready("g", 2, state)[0]
    # a report of an older generation changes nothing
    board.sender_check_in("g", "s", **kw, policy_version=3)
    board.receiver_check_in("g", "r2", backend="gloo", world_size=0, policy_version=3, failed_generation=1)
    assert board.group("g").generation == 2
    # the sender failed too and re-formed on a new store; its late check-in from the old one is turned
    # away and opens nothing
    board.sender_check_in("g", "s", **{**kw, "master_port": 6}, policy_version=4)
    with pytest.raises(FailedPrecondition, match="stale"):
        board.sender_check_in("g", "s", **kw, policy_version=3)
    assert board.group("g").master_port == 6 and board.group("g").generation == 3


def test_rendezvous_the_sender_hears_at_once_of_a_version_its_receivers_skipped() -> None:
    board = RendezvousBoard()
    state = board.sender_check_in("g", "s", world_size=2, backend="gloo", master_address="h", master_port=5, policy_version=3)
    board.receiver_check_in("g", "r", backend="gloo", world_size=0, policy_version=4)
    with pytest.raises(FailedPrecondition, match="asked for a newer version only"):
        board.sender_ready("g", 3, state)
    newer = board.sender_check_in("g", "s", world_size=2, backend="gloo", master_address="h", master_port=7,
                                  policy_version=4)
    with pytest.raises(FailedPrecondition, match="replaced this one"):
        board.sender_ready("g", 3, state)
    assert newer.generation == 2 and board.sender_ready("g", 4, newer) == (False, "0 of 1 receivers checked in for version 4 ([])")


def test_rendezvous_a_newcomer_takes_the_place_of_a_member_gone_silent_while_the_sender_waits() -> None:
    """A rollout replica that died holds its rank, and the group's size is fixed: its replacement
    found the group full and the sender waited for the dead member until transfer_timeout_s (300
    s; measured with gloo in a real run, 2026-12-05). A newcomer now takes the place of a member
    the sender waits for that has been silent for replace_after_s; a member that is merely slow
    (heard from lately), or one already checked in for the sender's version, keeps its place."""
    now = [0.0]
    board = RendezvousBoard(replace_after_s=60.0, clock=lambda: now[0])
    kw: dict = {"world_size": 3, "backend": "gloo", "master_address": "h", "master_port": 5}
    board.sender_check_in("g", "s", **kw, policy_version=1)
    for r in ("r1", "r2"):
        board.receiver_check_in("g", r, backend="gloo", world_size=0, policy_version=1)
    now[0] = 10.0
    state = board.sender_check_in("g", "s", **kw, policy_version=2)  # steady: r2 died before checking in
    board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=2)
    now[0] = 59.0  # r2 was last heard from at 0 s: not yet silent for 60 s
    with pytest.raises(ResourceExhausted, match=r"silent for 60s .*quietest has been silent 59s"):
        board.receiver_check_in("g", "r3", backend="gloo", world_size=0, policy_version=2)
    assert board.group("g").generation == 1 and board.group("g").ranks == {"r1": 1, "r2": 2}  # no trace
    now[0] = 60.0
    got, changed = board.receiver_check_in("g", "r3", backend="gloo", world_size=0, policy_version=2)
    assert changed and got is None  # generation 2: r1 joins it too (its waiting call checks in again)
    cur = board.group("g")
    assert cur.generation == 2 and cur.ranks == {"r3": 1} and cur.master_port == 5
    assert board.sender_ready("g", 2, state) == (False, "1 of 2 receivers checked in for version 2 (['r3'])")
    got, _ = board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=2)
    assert got is not None and (got.generation, got.rank) == (2, 2) and board.sender_ready("g", 2, state)[0]
    # r2 comes back after all (it was only stalled): the group is full of members heard from lately
    now[0] = 100.0
    board.sender_check_in("g", "s", **kw, policy_version=3)
    board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=3)
    with pytest.raises(ResourceExhausted, match="full"):  # r3 (heard from at 60 s) is not silent for 60 s
        board.receiver_check_in("g", "r2", backend="gloo", world_size=0, policy_version=3)
    now[0] = 1000.0
    with pytest.raises(FailedPrecondition, match="gone"):  # a newcomer asking for an old version replaces no one
        board.receiver_check_in("g", "r2", backend="gloo", world_size=0, policy_version=2)
    assert board.group("g").generation == 2
    # r3 went silent too: it is replaced; r1, checked in for version 3 (its call waits), was not
    # silent, and joins the new generation with its next check-in
    got, changed = board.receiver_check_in("g", "r2", backend="gloo", world_size=0, policy_version=3)
    assert changed and got is None and board.group("g").generation == 3 and board.group("g").ranks == {"r2": 1}
    got, _ = board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=3)
    assert got is not None and (got.generation, got.rank) == (3, 2)


def test_rendezvous_a_newcomer_after_the_version_went_through_waits_for_the_sender_to_send_it_again() -> None:
    """One receiver got version 2 and died (a single rollout replica killed right after loading
    it); its replacement asks for version 2. The dead member had checked in for 2, so it was never
    counted as gone: the replacement was turned away for good, and the trainer, with no groups to
    train on, never sent a next version (the run stood still; chaos tier, 2026-12-06). Now no
    member is waited for once the sender's barrier was answered: the silent one is replaced, and
    the new generation's receivers are answered only after the sender checks in there (they would
    otherwise form a group without rank 0). `wanted_again` tells the sender's probe so."""
    now = [0.0]
    board = RendezvousBoard(replace_after_s=15.0, clock=lambda: now[0])
    kw: dict = {"world_size": 2, "backend": "gloo", "master_address": "h", "master_port": 5}
    for v in (1, 2):
        state = board.sender_check_in("g", "s", **kw, policy_version=v)
        assert not board.wanted_again("g", v)
        got, _ = board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=v)
        assert got is not None and board.sender_ready("g", v, state)[0]
        board.sender_done("g", state, v, answered=True)
    assert not board.wanted_again("g", 2)  # every receiver holds it
    now[0] = 14.0
    with pytest.raises(ResourceExhausted, match="full"):  # r1 was heard from 14 s ago
        board.receiver_check_in("g", "r2", backend="gloo", world_size=0, policy_version=2)
    now[0] = 15.0
    got, changed = board.receiver_check_in("g", "r2", backend="gloo", world_size=0, policy_version=2)
    assert changed and got is None  # the group is complete, but the sender is not in generation 2
    cur = board.group("g")
    assert (cur.generation, cur.ranks, cur.sender_in) == (2, {"r2": 1}, False)
    assert board.wanted_again("g", 2) and not board.wanted_again("g", 1) and not board.wanted_again("other", 2)
    # the sender sends version 2 again: it checks in to generation 2, the receiver is answered
    again = board.sender_check_in("g", "s", **kw, policy_version=2)
    assert again.generation == 2 and board.sender_ready("g", 2, again)[0] and not board.wanted_again("g", 2)
    got, _ = board.receiver_check_in("g", "r2", backend="gloo", world_size=0, policy_version=2)
    assert got is not None and (got.generation, got.rank) == (2, 1)
    board.sender_done("g", again, 2, answered=True)
    assert not board.wanted_again("g", 2)


def test_rendezvous_the_sender_follows_a_generation_opened_while_it_waits_and_leaves_it_when_its_call_ends() -> None:
    """A generation opened while the sender's check-in waits at its barrier (a member's failure
    report) carries the sender: its receivers are answered. One opened after the sender's call
    ended unanswered (a deadline) does not, until the sender checks in again; a stale call's end
    changes nothing of a newer check-in."""
    board = RendezvousBoard()
    kw: dict = {"world_size": 2, "backend": "gloo", "master_address": "h", "master_port": 5}
    state = board.sender_check_in("g", "s", **kw, policy_version=1)
    board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=1, failed_generation=1)
    got, _ = board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=1)
    assert got is not None and got.generation == 2  # the sender's waiting call moved with it
    board.sender_done("g", state, 1, answered=True)
    state = board.sender_check_in("g", "s", **kw, policy_version=2)
    board.sender_done("g", state, 2, answered=False)  # its deadline passed before r1 came
    got, _ = board.receiver_check_in("g", "r1", backend="gloo", world_size=0, policy_version=2)
    assert got is None and board.wanted_again("g", 2)
    newer = board.sender_check_in("g", "s", **{**kw, "master_port": 6}, policy_version=3)
    board.sender_done("g", state, 2, answered=False)  # the old call's end: the newer check-in owns the state
    assert board.group("g").sender_in and board.group("g") is newer


def test_an_object_store_lookup_of_a_version_not_in_the_object_store_takes_no_hold() -> None:
    """The Serve deployment's object_store_version (the object_store fetcher's lookup) checked the
    version's transport only after pinning it: the refused consumer held a grpc version's host
    buffers for hold_ttl_s (600 s) past retention, one more copy per version it retried."""
    import asyncio
    import types

    from services.param_server.deployment import ParamServerDeployment

    store = WeightStore(StoreSettings(retain_versions=1))
    m, buffers = make_version(1)
    upload(store, m, buffers, 0.0, manifest_first=True)  # over grpc: no object refs
    deployment = types.SimpleNamespace(_servicer=types.SimpleNamespace(store=store))
    lookup = ParamServerDeployment.func_or_class.object_store_version
    with pytest.raises(FailedPrecondition, match="not in the object store"):
        asyncio.run(lookup(deployment, 1, "rollout-0"))
    with pytest.raises(FailedPrecondition, match="not in the object store"):
        asyncio.run(lookup(deployment, -1, "rollout-0"))  # the newest
    assert store.get(1).holds == {}
    for v in (2, 3):
        mv, bv = make_version(v)
        upload(store, mv, bv, 1.0, manifest_first=True)
    with pytest.raises(NotFound):
        store.get(1)  # evicted at once: nothing pins it


def test_the_refusal_of_a_loaded_orphan_names_who_loaded_it_and_the_way_out() -> None:
    """A dead trainer's uncommitted version that a consumer loaded (AcquireVersion / FetchWeights,
    of the newest too) stays immutable, and the resumed trainer's republish of its number, the only
    one CommitVersion takes, is refused on every restart. The refusal said "publish a newer
    version", which the trainer cannot do; it names who loaded it and the way out."""
    store = WeightStore(StoreSettings())
    orphan, orphan_buffers = make_version(18)
    upload(store, orphan, orphan_buffers, 0.0, manifest_first=True)
    store.acquire("eval-job", -1, 0.5)
    store.release("eval-job", 18, 0.6)
    resumed, resumed_buffers = make_version(18, seed=9)
    with pytest.raises(FailedPrecondition, match="immutable once seen") as info:
        upload(store, resumed, resumed_buffers, 1.0, manifest_first=True)
    msg = str(info.value)
    assert "eval-job" in msg, msg
    assert "restart the param server" in msg and "publish a newer version" not in msg, msg
