"""What a client can make the param server hold: bucket metadata before an upload opens is
checked as it comes (a stream of it alone is refused at the quota), a registration stream holds
one manifest, and a receiver's check-in that gives up leaves no entry on the rendezvous board."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import DeadlineExceeded, InvalidArgument, MeshError, ResourceExhausted
from services.common.grpc_util import LocalContext
from services.param_server.servicer import ParamServerServicer
from services.param_server.store import StoreSettings, WeightStore
from services.weights import convert
from tests.unit.test_param_server_store import make_version


def test_publish_bucket_metas_before_any_manifest_are_bounded_by_the_upload_quota() -> None:
    """BucketMeta before the first manifest or chunk is held until the upload opens: checked as
    it comes, the stream is refused once the declared bytes pass max_upload_bytes (it was read to
    the end, up to transfer_timeout_s, all of it held, and the quota never checked)."""
    quota = 1000
    store = WeightStore(StoreSettings(max_upload_bytes=quota))
    servicer = ParamServerServicer(store, clock=lambda: 1.0)
    sent = 0

    async def stream() -> AsyncIterator[pb.PublishWeightsRequest]:
        nonlocal sent
        for i in range(5000):
            sent += 1
            yield pb.PublishWeightsRequest(bucket=pb.BucketMeta(index=i, nbytes=600, fingerprint="f"))

    async def publish() -> None:
        await servicer.PublishWeights(stream(), LocalContext())

    with pytest.raises(MeshError) as info:
        asyncio.run(publish())
    # 600 + 600 bytes pass the 1000-byte quota at the second bucket.
    assert sent <= 3, f"the servicer read and buffered {sent} bucket messages ({info.value!r})"
    assert isinstance(info.value, ResourceExhausted), info.value


def test_a_registration_stream_with_a_second_manifest_is_refused_and_registers_nothing() -> None:
    """A stream of manifests only (the bytes travel by disk, object store, collective) with a
    second manifest is refused, as a grpc upload's is; the second used to replace the first
    silently, and a grpc manifest after it registered the first and dropped the rest."""
    store = WeightStore(StoreSettings())
    servicer = ParamServerServicer(store, clock=lambda: 1.0)
    disk5, disk6 = (replace(make_version(v)[0], transports=("disk",)) for v in (5, 6))

    async def stream() -> AsyncIterator[pb.PublishWeightsRequest]:
        yield pb.PublishWeightsRequest(manifest=convert.manifest_to_proto(disk5))
        yield pb.PublishWeightsRequest(manifest=convert.manifest_to_proto(disk6))

    async def publish() -> None:
        try:
            await servicer.PublishWeights(stream(), LocalContext())
        finally:
            await servicer.close()

    with pytest.raises(InvalidArgument, match="manifest"):
        asyncio.run(publish())
    assert [s.policy_version for s in store.versions()] == [], "a refused stream registers nothing"


def test_receiver_check_ins_that_time_out_leave_nothing_on_the_rendezvous_board() -> None:
    """A withdrawn check-in (deadline, cancel) leaves no empty per-version entries behind: a
    client checking in for ever newer versions with a short deadline grew the board by two
    entries per call until the sender passed them."""
    servicer = ParamServerServicer(WeightStore(StoreSettings()), clock=lambda: 1.0, transfer_timeout_s=0.0)
    servicer.board.sender_check_in("g", "t0", world_size=2, backend="gloo", master_address="h", master_port=1234,
                                   policy_version=1)

    async def check_in(version: int) -> None:
        req = pb.RendezvousRequest(role="receiver", group="g", member_id="r0", backend="gloo", world_size=2,
                                   policy_version=version)
        with pytest.raises(DeadlineExceeded):
            await servicer.Rendezvous(req, LocalContext())

    async def many() -> None:
        for v in range(2, 502):
            await check_in(v)

    asyncio.run(many())
    state = servicer.board.group("g")
    assert state is not None
    assert len(state.checked_in) <= 1 and len(state.delta_bases) <= 1, (len(state.checked_in), len(state.delta_bases))


def test_publish_over_max_concurrent_uploads_is_transient_so_the_trainer_retries_it() -> None:
    """A publish past param_server.max_concurrent_uploads waits only for a stream to end (or be
    dropped after stall_timeout_s): the answer is transient, which the trainer's publish retries
    with backoff (TrainerLoop._republish). It was RESOURCE_EXHAUSTED, and the trainer's loop
    failed outright whenever attempts it had given up on still held the slots."""
    from services.common.errors import transient

    store = WeightStore(StoreSettings())
    servicer = ParamServerServicer(store, clock=lambda: 1.0, max_concurrent_uploads=1)
    servicer.uploads_in_flight = 1  # another stream holds the only slot

    async def stream() -> AsyncIterator[pb.PublishWeightsRequest]:
        yield pb.PublishWeightsRequest(manifest=convert.manifest_to_proto(make_version(1)[0]))

    async def publish() -> None:
        await servicer.PublishWeights(stream(), LocalContext())

    with pytest.raises(MeshError) as info:
        asyncio.run(publish())
    assert transient(info.value), info.value
    assert "param_server.max_concurrent_uploads=1" in str(info.value) and "stall_timeout_s" in str(info.value)
    assert servicer.uploads_in_flight == 1 and store.versions() == []  # refused: nothing taken or registered
