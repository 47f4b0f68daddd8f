"""Group bytes cross the coordinator unchanged (services/coordinator/wire.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.v1 import common_pb2, coordinator_pb2
from services.common.errors import InvalidArgument
from services.coordinator import wire


def _group(k: int, tokens: int = 5) -> common_pb2.TrajectoryGroup:
    g = common_pb2.TrajectoryGroup(lease_id=f"lease-{k}", prompt_token_ids=[1, 2, 3], replica_id="r")
    g.prompt.prompt_seq = k
    g.prompt.text = "ü" * k  # multi-byte text: lengths are bytes, not characters
    for i in range(2):
        g.responses.add(sample_index=i, token_ids=[4] * tokens, logprobs=[-0.25] * tokens, versions=[k] * tokens,
                        reward=0.5, reward_metrics={"acc": 1.0})
    return g


def test_submit_bytes_are_the_request_a_generated_client_sends_and_split_back_unchanged() -> None:
    groups = [_group(k, tokens=k * 40) for k in range(5)]
    data = wire.submit_request_bytes("replica-ä", groups)
    assert coordinator_pb2.SubmitGroupsRequest.FromString(data) == coordinator_pb2.SubmitGroupsRequest(
        replica_id="replica-ä", groups=groups
    )
    raw = wire.split_submit(data)
    assert raw.replica_id == "replica-ä"
    assert raw.groups == groups
    assert raw.payloads == [g.SerializeToString() for g in groups]


def test_split_skips_fields_it_does_not_know() -> None:
    """A newer client may send fields this server does not know (proto3 forward compatibility)."""
    extra = wire.varint(9 << 3 | 0) + wire.varint(300) + wire.frame(10, b"x" * 3) + wire.varint(11 << 3 | 5) + b"abcd"
    data = extra + wire.submit_request_bytes("r", [_group(1)]) + wire.varint(12 << 3 | 1) + b"12345678"
    raw = wire.split_submit(data)
    assert raw.replica_id == "r" and raw.groups == [_group(1)]


@pytest.mark.parametrize(
    "data",
    [
        b"\x12\x05abc",  # a group that runs past the end
        b"\x12\x03\xff\xff\xff",  # not a TrajectoryGroup
        b"\x0a\x02\xc3\x28",  # replica_id is not UTF-8
        b"\x0b",  # wire type 3 (groups of proto2) is not valid here
        b"\x12" + b"\xff" * 11,  # a varint longer than 64 bits
    ],
)
def test_undecodable_requests_are_invalid_argument(data: bytes) -> None:
    with pytest.raises(InvalidArgument):
        wire.split_submit(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_invalid_argument(data: bytes) -> None:
    try:
        wire.split_submit(data)
    except InvalidArgument:
        pass


def test_fetch_reply_is_a_fetch_batch_response() -> None:
    groups = [_group(k) for k in range(3)]
    head = coordinator_pb2.FetchBatchResponse(policy_version=7, staleness=[0, 1, 2], exhausted=True, regenerated=2)
    reply = wire.fetch_reply(head, [g.SerializeToString() for g in groups])
    expected = coordinator_pb2.FetchBatchResponse(
        groups=groups, policy_version=7, staleness=[0, 1, 2], exhausted=True, regenerated=2
    )
    assert reply.parse() == expected
    assert reply.ByteSize() == len(reply.SerializeToString())
    assert wire.fetch_reply(coordinator_pb2.FetchBatchResponse(), []).parse() == coordinator_pb2.FetchBatchResponse()
