"""Group payloads cross the coordinator as bytes: SubmitGroups and FetchBatch skip the parse and
serialize round trips a generated handler would make.

A queued group is stored as the exact bytes the rollout sent (its TrajectoryGroup) and handed to
the trainer as those bytes again. Two RPCs are registered with pass-through (de)serializers:

    SubmitGroups  the request arrives as bytes (`request_deserializer=None`; under Ray Serve the
                  proxy then forwards bytes instead of a message it parsed and Ray pickled);
                  `split_submit` cuts it into its groups' byte strings, each parsed once to be
                  validated and stored as it came.
    FetchBatch    the reply is built as bytes (`SerializedReply`): the scalar fields serialized as a
                  message, then each stored group framed as field 1. Protobuf parses fields in any
                  order, so this is the FetchBatchResponse a generated client expects.

The client sends SubmitGroups the same way (`submit_request_bytes`), without copying every group
into a new request message first. Every other RPC keeps the generated handlers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from meshrl.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.common.errors import InvalidArgument

SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name
_SUBMIT = coordinator_pb2.SubmitGroupsRequest.DESCRIPTOR.fields_by_name
_REPLICA_ID = _SUBMIT["replica_id"].number
_GROUPS = _SUBMIT["groups"].number
_FETCH_GROUPS = coordinator_pb2.FetchBatchResponse.DESCRIPTOR.fields_by_name["groups"].number
_LEN = 2  # wire type of length-delimited fields


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise InvalidArgument("request", "truncated or malformed varint in the SubmitGroups request")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def frame(field: int, payload: bytes) -> bytes:
    """`payload` as length-delimited field `field` of an enclosing message."""
    return varint(field << 3 | _LEN) + varint(len(payload)) + payload


class RawSubmit:
    """A SubmitGroupsRequest as it came: the replica id, and each group both parsed (to validate)
    and as its original bytes (to store)."""

    def __init__(self, replica_id: str, groups: list[common_pb2.TrajectoryGroup], payloads: list[bytes]) -> None:
        self.replica_id = replica_id
        self.groups = groups
        self.payloads = payloads


def split_submit(data: bytes, max_groups: int | None = None) -> RawSubmit:
    """Cut a serialized SubmitGroupsRequest into its parts. Undecodable bytes -> InvalidArgument.
    More than `max_groups` groups is refused before the one past it is parsed: a request of
    millions of empty groups would otherwise be decoded whole, then refused."""
    replica_id = ""
    groups: list[common_pb2.TrajectoryGroup] = []
    payloads: list[bytes] = []
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _read_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _LEN:
            size, pos = _read_varint(data, pos)
            if pos + size > end:
                raise InvalidArgument("request", "truncated SubmitGroups request (a field runs past its end)")
            chunk = data[pos : pos + size]
            pos += size
            if field == _REPLICA_ID:
                try:
                    replica_id = chunk.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidArgument("replica_id", "is not valid UTF-8") from None
            elif field == _GROUPS:
                if max_groups is not None and len(groups) >= max_groups:
                    raise InvalidArgument("groups", f"more than {max_groups} in one call (coordinator.max_groups_per_call)")
                try:
                    groups.append(common_pb2.TrajectoryGroup.FromString(chunk))
                except DecodeError:
                    raise InvalidArgument(f"groups[{len(groups)}]", "is not a decodable TrajectoryGroup") from None
                payloads.append(chunk)
        elif wire_type == 0:
            _, pos = _read_varint(data, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise InvalidArgument("request", f"field {field} has wire type {wire_type}, not valid in SubmitGroupsRequest")
    if pos != end:
        raise InvalidArgument("request", "truncated SubmitGroups request")
    return RawSubmit(replica_id, groups, payloads)


def as_raw_submit(request: bytes | coordinator_pb2.SubmitGroupsRequest, max_groups: int | None = None) -> RawSubmit:
    """Bytes from the pass-through handler, or a message from an in-process caller."""
    if isinstance(request, bytes):
        return split_submit(request, max_groups)
    groups = list(request.groups)
    return RawSubmit(request.replica_id, groups, [g.SerializeToString() for g in groups])


def submit_request_bytes(replica_id: str, groups: Sequence[common_pb2.TrajectoryGroup]) -> bytes:
    """A serialized SubmitGroupsRequest, each group serialized once, straight into it."""
    parts = [frame(_REPLICA_ID, replica_id.encode("utf-8"))]
    parts += [frame(_GROUPS, g.SerializeToString()) for g in groups]
    return b"".join(parts)


class SerializedReply:
    """A reply already in wire form; gRPC (and Ray Serve's replica) call SerializeToString."""

    def __init__(self, data: bytes, message_type: type[Any]) -> None:
        self._data = data
        self._type = message_type

    def SerializeToString(self) -> bytes:
        return self._data

    def ByteSize(self) -> int:
        return len(self._data)

    def parse(self) -> Any:
        """The reply as a message (in-process callers, tests)."""
        return self._type.FromString(self._data)


def fetch_reply(head: coordinator_pb2.FetchBatchResponse, payloads: Sequence[bytes]) -> SerializedReply:
    """FetchBatchResponse = `head` (every field but the groups) + the stored groups as field 1."""
    data = head.SerializeToString() + b"".join(frame(_FETCH_GROUPS, p) for p in payloads)
    return SerializedReply(data, coordinator_pb2.FetchBatchResponse)


def _serialize(reply: Any) -> bytes:
    return bytes(reply.SerializeToString())


def add_to_server(servicer: Any, server: Any) -> None:
    """`add_CoordinatorServiceServicer_to_server` with the two pass-through handlers. Also the
    servicer function Ray Serve's gRPC proxy is started with (serve_util.SERVICER_FUNCTIONS)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}

    class _Capture:
        def add_generic_rpc_handlers(self, generic: Any) -> None:
            pass

        def add_registered_method_handlers(self, name: str, method_handlers: dict[str, grpc.RpcMethodHandler]) -> None:
            handlers.update(method_handlers)

    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, _Capture())
    replace: Callable[..., grpc.RpcMethodHandler]
    replace = handlers["SubmitGroups"]._replace  # type: ignore[attr-defined]
    handlers["SubmitGroups"] = replace(request_deserializer=None)
    replace = handlers["FetchBatch"]._replace  # type: ignore[attr-defined]
    handlers["FetchBatch"] = replace(response_serializer=_serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE, handlers)
