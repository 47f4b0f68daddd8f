"""Hypothesis strategies that build any protobuf message from its descriptor, with the values an
attacker (or a buggy client) sends: integer extremes, NaN and infinities, empty, long and odd
strings, unknown enum numbers, nesting."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from .mesh import message_class

T = FieldDescriptor
_INT_RANGES = {
    T.TYPE_INT32: (-(2**31), 2**31 - 1), T.TYPE_SINT32: (-(2**31), 2**31 - 1), T.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    T.TYPE_INT64: (-(2**63), 2**63 - 1), T.TYPE_SINT64: (-(2**63), 2**63 - 1), T.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    T.TYPE_UINT32: (0, 2**32 - 1), T.TYPE_FIXED32: (0, 2**32 - 1),
    T.TYPE_UINT64: (0, 2**64 - 1), T.TYPE_FIXED64: (0, 2**64 - 1),
}


def _int(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (lo, hi, 0, 1, -1, 2, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(min(max(lo, -3), hi), min(hi, 64)), st.integers(lo, hi))


_FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, 1e-30]),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.floats(-10, 10),
)
_TEXT = st.one_of(
    st.sampled_from(["", "r", "rollout-0", "lease-1", "sender", "receiver", "gloo", "grpc", "openai/gsm8k",
                     "meshrl/addition", "127.0.0.1:1", "{}", '{"a": 1}', "[[[[", "\x00", "é" * 3]),
    st.text(max_size=16),
    st.text(min_size=300, max_size=600),
    st.builds(lambda n: "x" * n, st.sampled_from([257, 513, 1025, 5000])),
)
_BYTES = st.one_of(st.binary(max_size=32), st.builds(lambda n: b"\x01" * n, st.sampled_from([1024, 100_000])))


def _scalar(fd: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = fd.type
    if t in _INT_RANGES:
        return _int(*_INT_RANGES[t])
    if t in (T.TYPE_DOUBLE, T.TYPE_FLOAT):
        floats = _FLOATS if t == T.TYPE_DOUBLE else _FLOATS.map(lambda x: x if abs(x) < 3e38 or x != x else float("inf"))
        return floats
    if t == T.TYPE_BOOL:
        return st.booleans()
    if t == T.TYPE_STRING:
        return _TEXT
    if t == T.TYPE_BYTES:
        return _BYTES
    if t == T.TYPE_ENUM:
        numbers = [v.number for v in fd.enum_type.values]  # type: ignore[union-attr]
        return st.one_of(st.sampled_from(numbers), st.integers(-5, 50))
    raise AssertionError(f"unhandled field type {t}")


@st.composite
def _message(draw: st.DrawFn, desc: Descriptor, depth: int) -> Message:
    msg = message_class(desc)()
    for fd in desc.fields:
        if draw(st.integers(0, 3)) == 0:  # most fields set: a request needs its ids to get past them
            continue
        is_msg = fd.type == T.TYPE_MESSAGE
        if is_msg and fd.message_type.GetOptions().map_entry:  # type: ignore[union-attr]
            key_fd = fd.message_type.fields_by_name["key"]  # type: ignore[union-attr]
            val_fd = fd.message_type.fields_by_name["value"]  # type: ignore[union-attr]
            for k in draw(st.lists(_scalar(key_fd), max_size=3)):
                if val_fd.type == T.TYPE_MESSAGE:
                    if depth > 0:
                        getattr(msg, fd.name)[k].CopyFrom(draw(_message(val_fd.message_type, depth - 1)))
                else:
                    getattr(msg, fd.name)[k] = draw(_scalar(val_fd))
        elif is_msg:
            if depth <= 0:
                continue
            sub = _message(fd.message_type, depth - 1)
            if fd.is_repeated:
                getattr(msg, fd.name).extend(draw(st.lists(sub, max_size=3)))
            else:
                getattr(msg, fd.name).CopyFrom(draw(sub))
        elif fd.is_repeated:
            getattr(msg, fd.name).extend(draw(st.lists(_scalar(fd), max_size=5)))
        else:
            setattr(msg, fd.name, draw(_scalar(fd)))
    return msg


def messages(desc: Descriptor, depth: int = 4) -> st.SearchStrategy[Message]:
    """Any message of type DESC (fields set at random, values as the module docstring says)."""
    return _message(desc, depth)
