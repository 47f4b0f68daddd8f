"""Zero-copy protobuf codec for the messages that carry weight bytes.

`PublishWeightsRequest` and `FetchWeightsResponse` put a `WeightsChunk` in field 2. Building one
through the protobuf runtime copies the payload twice (into the message, then into the encoded
string) and parsing copies it again; at GB/s that is most of the cost. These encoders write the
standard wire format by hand around the payload (one copy, into the encoded string), and the
decoders return the payload as a memoryview into the received string (no copy). Any other message
goes through the protobuf runtime, and anything unexpected falls back to it, so peers that use
plain generated stubs interoperate unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from meshrl.v1 import param_server_pb2

SERVICE = "meshrl.v1.ParamServerService"
PUBLISH_METHOD = f"/{SERVICE}/PublishWeights"
FETCH_METHOD = f"/{SERVICE}/FetchWeights"
_CHUNK_FIELD_TAG = 0x12  # field 2, length-delimited


@dataclass(frozen=True)
class RawChunk:
    """A WeightsChunk whose data is a view (no copy)."""

    policy_version: int
    bucket_index: int
    offset: int
    data: memoryview

    def to_proto(self) -> param_server_pb2.WeightsChunk:
        return param_server_pb2.WeightsChunk(
            policy_version=self.policy_version, bucket_index=self.bucket_index, offset=self.offset,
            data=bytes(self.data),
        )

    @staticmethod
    def from_proto(p: param_server_pb2.WeightsChunk) -> RawChunk:
        return RawChunk(p.policy_version, p.bucket_index, p.offset, memoryview(p.data))


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_chunk(chunk: RawChunk) -> bytes:
    """Outer message with `chunk` in field 2 (valid for both streaming message types)."""
    n = len(chunk.data)
    inner_head = b"".join((
        b"\x08", _varint(chunk.policy_version),
        b"\x10", _varint(chunk.bucket_index),
        b"\x18", _varint(chunk.offset),
        b"\x22", _varint(n),
    ))
    return b"".join((bytes((_CHUNK_FIELD_TAG,)), _varint(len(inner_head) + n), inner_head, chunk.data))


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def decode_chunk(raw: bytes) -> RawChunk | None:
    """The chunk in an outer message that holds only field 2; None if it is anything else."""
    buf = memoryview(raw)
    if not buf or buf[0] != _CHUNK_FIELD_TAG:
        return None
    try:
        length, pos = _read_varint(buf, 1)
        end = pos + length
        if end != len(buf):
            return None  # more outer fields follow: let protobuf decide
        version = index = offset = 0
        data = buf[0:0]
        while pos < end:
            tag, pos = _read_varint(buf, pos)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                value, pos = _read_varint(buf, pos)
                if field == 1:
                    version = value - (1 << 64) if value >= 1 << 63 else value
                elif field == 2:
                    index = value
                elif field == 3:
                    offset = value
            elif wire == 2:
                size, pos = _read_varint(buf, pos)
                if field == 4:
                    data = buf[pos : pos + size]
                pos += size
            else:
                return None
        if pos != end:
            return None
        return RawChunk(version, index, offset, data)
    except ValueError:
        return None


def _serializer(message: Any) -> bytes:
    if isinstance(message, RawChunk):
        return encode_chunk(message)
    return message.SerializeToString()  # type: ignore[no-any-return]


def _deserializer(cls: Any) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        chunk = decode_chunk(raw)
        return chunk if chunk is not None else cls.FromString(raw)

    return parse


publish_request_serializer = _serializer
publish_request_deserializer = _deserializer(param_server_pb2.PublishWeightsRequest)
fetch_response_serializer = _serializer
fetch_response_deserializer = _deserializer(param_server_pb2.FetchWeightsResponse)


def publish_callable(channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryMultiCallable:
    return channel.stream_unary(
        PUBLISH_METHOD,
        request_serializer=publish_request_serializer,
        response_deserializer=param_server_pb2.PublishWeightsResponse.FromString,
    )


def fetch_callable(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    return channel.unary_stream(
        FETCH_METHOD,
        request_serializer=param_server_pb2.FetchWeightsRequest.SerializeToString,
        response_deserializer=fetch_response_deserializer,
    )
