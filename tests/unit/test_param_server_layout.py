"""Bucket layout, fingerprints, manifests and the zero-copy chunk codec."""

from __future__ import annotations

import itertools
import pickle
import random
from collections.abc import Iterator

import pytest
import torch

from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import DataLoss, InvalidArgument
from services.weights import convert, wire
from services.weights.layout import (
    Fingerprinter,
    build_manifest,
    digest_columns,
    fingerprint_bytes,
    fingerprint_columns_async,
    fingerprint_tensor,
    from_wire,
    group_by_bytes,
    pack_bucket,
    pack_into,
    pack_stream,
    plan_bucket,
    storage_runs,
    to_wire,
    unpack,
    validate_manifest,
)


def mixed_bucket(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(33, 7, generator=g).bfloat16()),
        ("model.norm.weight", torch.randn(13, generator=g)),
        ("flag", torch.tensor(True)),
        ("counts", torch.arange(5, dtype=torch.int64)),
        ("half", torch.randn(3, 3, generator=g).half()),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("empty", torch.zeros(0, 4)),
        ("i8", torch.randint(-100, 100, (9,), dtype=torch.int8, generator=g)),
    ]


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_layout_aligns_every_tensor_without_padding_and_round_trips_bytes() -> None:
    bucket = mixed_bucket()
    metas, nbytes = plan_bucket(0, bucket)
    assert nbytes == sum(t.numel() * t.element_size() for _, t in bucket)
    assert [m.name for m in metas] == [n for n, _ in bucket]  # input order kept
    for m, (_, t) in zip(metas, bucket, strict=True):
        assert m.offset % t.element_size() == 0
    buf = torch.empty(nbytes, dtype=torch.uint8)
    pack_into(buf, bucket, metas)
    for (name, got), (_, want) in zip(unpack(buf, metas), bucket, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert raw(got) == raw(want), name


def test_non_contiguous_tensors_pack_as_their_values() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    metas, n = plan_bucket(0, [("w", t)])
    buf = torch.empty(n, dtype=torch.uint8)
    pack_into(buf, [("w", t)], metas)
    assert torch.equal(unpack(buf, metas)[0][1], t)


def test_unsupported_dtype_names_the_fix() -> None:
    with pytest.raises(InvalidArgument, match="cast it"):
        plan_bucket(0, [("x", torch.zeros(2, dtype=torch.complex64))])


def test_fingerprint_is_the_same_over_pieces_in_any_order_and_on_the_device_path() -> None:
    rng = random.Random(0)
    for _ in range(25):
        n = rng.randint(0, 9000)
        data = torch.randint(0, 256, (n + 8,), dtype=torch.uint8)
        data[n:] = 0
        whole = fingerprint_bytes(data.numpy()[:n])
        assert whole == digest_columns(fingerprint_columns_async(data, n).tolist(), n)
        cuts = sorted({0, n, *(rng.randint(0, n) for _ in range(4))})
        pieces = list(itertools.pairwise(cuts))
        rng.shuffle(pieces)
        fp = Fingerprinter(n)
        for a, b in pieces:
            fp.update(a, data.numpy()[a:b])
        assert fp.hexdigest() == whole


def test_fingerprint_catches_flips_block_swaps_and_truncation() -> None:
    data = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    base = fingerprint_tensor(data, data.numel())
    flipped = data.clone()
    flipped[12345] ^= 0x10
    assert fingerprint_tensor(flipped, data.numel()) != base
    swapped = data.clone()
    swapped[:4096], swapped[4096:8192] = data[4096:8192].clone(), data[:4096].clone()
    assert fingerprint_tensor(swapped, data.numel()) != base
    zero_tail = torch.cat([data, torch.zeros(8, dtype=torch.uint8)])
    assert fingerprint_bytes(zero_tail.numpy()) != base  # same words, other length


def test_manifest_checksum_and_validation() -> None:
    bucket = mixed_bucket()
    metas, n = plan_bucket(0, bucket)
    buf = torch.empty(n, dtype=torch.uint8)
    pack_into(buf, bucket, metas)
    from services.weights.layout import BucketMeta

    m = build_manifest(3, metas, [BucketMeta(0, n, fingerprint_tensor(buf, n))], transports=["grpc"])
    validate_manifest(m)
    again = convert.manifest_from_proto(convert.manifest_to_proto(m))
    assert again == m
    assert again.with_transports(["disk"]).checksum == m.checksum  # transports are not content
    with pytest.raises(InvalidArgument, match="checksum"):
        validate_manifest(build_manifest(4, metas, m.buckets).__class__(**{**m.__dict__, "policy_version": 4}))
    overlapping = m.__class__(**{**m.__dict__, "tensors": (m.tensors[0], m.tensors[0].__class__(
        **{**m.tensors[1].__dict__, "offset": m.tensors[0].offset}))})
    with pytest.raises(InvalidArgument):
        validate_manifest(overlapping)
    assert m.buckets_for_names(["flag"]) == [0]
    with pytest.raises(InvalidArgument, match="not in version"):
        m.buckets_for_names(["nope"])


@pytest.mark.parametrize("version", [0, 7, 1 << 40, -1])
def test_raw_chunk_codec_is_standard_protobuf(version: int) -> None:
    data = bytes(range(256)) * 40
    chunk = wire.RawChunk(version, 3, 1 << 33, memoryview(data))
    encoded = wire.encode_chunk(chunk)
    for cls in (pb.FetchWeightsResponse, pb.PublishWeightsRequest):
        parsed = cls.FromString(encoded)
        assert parsed.chunk.policy_version == version and parsed.chunk.bucket_index == 3
        assert parsed.chunk.offset == 1 << 33 and parsed.chunk.data == data
    decoded = wire.decode_chunk(encoded)
    assert decoded is not None and bytes(decoded.data) == data and decoded.policy_version == version
    # Messages built by plain protobuf decode the same way; anything else falls back to protobuf.
    std = pb.FetchWeightsResponse(chunk=pb.WeightsChunk(policy_version=version, bucket_index=3, data=b"xy"))
    got = wire.fetch_response_deserializer(std.SerializeToString())
    assert isinstance(got, wire.RawChunk) and bytes(got.data) == b"xy"
    man = pb.FetchWeightsResponse(manifest=pb.Manifest(policy_version=5))
    assert wire.fetch_response_deserializer(man.SerializeToString()).manifest.policy_version == 5


def test_verify_bucket_reports_what_differs() -> None:
    from services.weights.layout import BucketMeta, verify_bucket

    meta = BucketMeta(2, 10, "ab" * 16)
    with pytest.raises(DataLoss, match="got 9 bytes"):
        verify_bucket(meta, fingerprint="ab" * 16, nbytes=9)
    with pytest.raises(DataLoss, match="fingerprint"):
        verify_bucket(meta, fingerprint="cd" * 16, nbytes=10)


def _digest_by_definition(columns: list[int], nbytes: int) -> str:
    from services.weights.layout import _MASK64, _MIX_A, _MIX_B

    a, b = nbytes * _MIX_A[-1], nbytes * _MIX_B[-1]
    for c, s in enumerate(columns):
        a += (s & _MASK64) * _MIX_A[c]
        b += (s & _MASK64) * _MIX_B[c]
    return f"{a & _MASK64:016x}{b & _MASK64:016x}"


def test_vectorized_digest_matches_the_big_integer_definition_for_every_input_kind() -> None:
    import numpy as np

    from services.weights.layout import FINGERPRINT_COLUMNS, digest_columns

    rng = np.random.default_rng(3)
    for nbytes in (0, 7, 2**40 + 3):
        cols = [int(x) for x in rng.integers(-(2**63), 2**63 - 1, FINGERPRINT_COLUMNS, dtype=np.int64)]
        want = _digest_by_definition(cols, nbytes)
        assert digest_columns(cols, nbytes) == want
        assert digest_columns(torch.tensor(cols, dtype=torch.int64), nbytes) == want
        assert digest_columns(np.array(cols, dtype=np.int64), nbytes) == want
        assert digest_columns(np.array(cols, dtype=np.int64).view(np.uint64), nbytes) == want


def test_pack_into_concatenates_a_back_to_back_bucket_and_copies_a_mixed_one() -> None:
    g = torch.Generator().manual_seed(5)
    named = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).bfloat16()),
             ("c", torch.tensor([True, False, True])), ("d", torch.randn(4, 4, generator=g).t())]
    metas, nbytes = plan_bucket(0, named)
    fast = torch.full((nbytes + 5,), 0xAB, dtype=torch.uint8)
    pack_into(fast, named, metas)  # one torch.cat: the tensors tile [0, nbytes) back to back
    slow = torch.full((nbytes + 5,), 0xAB, dtype=torch.uint8)
    for (_, t), m in zip(named, metas, strict=True):  # the definition: each tensor at its offset
        slow[m.offset : m.offset + m.nbytes] = t.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(fast, slow)  # the bytes past the bucket are untouched
    for (name, t), (uname, u) in zip(named, unpack(fast, metas), strict=True):
        assert name == uname and torch.equal(t, u)


def test_split_buckets_keeps_tensor_order_and_puts_a_larger_tensor_alone() -> None:
    import asyncio

    from services.weights.transports.base import split_buckets

    def t(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8)

    buckets = [[("a", t(300)), ("b", t(300)), ("c", t(500)), ("d", t(1500)), ("e", t(10))], [], [("f", t(2))]]

    async def run() -> list[list[tuple[str, int]]]:
        return [[(n, x.numel()) for n, x in b] async for b in split_buckets(buckets, 1000)]

    assert asyncio.run(run()) == [[("a", 300), ("b", 300)], [("c", 500)], [("d", 1500)], [("e", 10)], [("f", 2)]]


def test_pack_bucket_is_one_buffer_in_the_layout_holding_every_value() -> None:
    named = [*mixed_bucket(2), ("transposed", torch.randn(4, 6).t())]
    packed = pack_bucket(named)
    metas, nbytes = plan_bucket(0, named)
    base = packed[0][1].untyped_storage()
    assert base.nbytes() == nbytes
    for (name, t), (pname, p), m in zip(named, packed, metas, strict=True):
        assert name == pname and p.dtype == t.dtype and p.shape == t.shape and torch.equal(p, t)
        if p.numel():  # each tensor at its plan_bucket offset in the one storage
            assert p.untyped_storage().data_ptr() == base.data_ptr() and p.data_ptr() - base.data_ptr() == m.offset
    assert plan_bucket(0, packed)[0] == metas  # the packed bucket lays out as its source did
    source = named[1][1].clone()
    named[1][1].add_(1)  # a copy, not views of the source
    assert torch.equal(packed[1][1], source)


def test_pack_stream_groups_as_group_by_bytes_and_copies_each_tensor_as_it_arrives() -> None:
    named = [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate([100, 100, 300, 50, 10])]
    named.append(("h", torch.arange(6, dtype=torch.int64).view(2, 3)))
    specs = [(n, tuple(t.shape), t.dtype) for n, t in named]
    taken: list[str] = []

    def source() -> Iterator[torch.Tensor]:
        for n, t in named:
            taken.append(n)
            yield t

    got = []
    for bucket in pack_stream(specs, source(), 800):
        assert taken[-1] == bucket[-1][0]  # nothing asked for beyond the bucket being yielded
        got.append(bucket)
    groups = [[n for n, _ in b] for b in group_by_bytes(named, 800)]
    assert [[n for n, _ in b] for b in got] == groups == [["t0", "t1"], ["t2"], ["t3", "t4", "h"]]
    for bucket in got:
        assert len({t.untyped_storage().data_ptr() for _, t in bucket}) == 1
        assert plan_bucket(0, bucket)[0] == plan_bucket(0, [(n, dict(named)[n]) for n, _ in bucket])[0]
        assert all(t.dtype == dict(named)[n].dtype and torch.equal(t, dict(named)[n]) for n, t in bucket)


@pytest.mark.parametrize(("tensors", "error"), [
    ([torch.zeros(4), torch.zeros(3)], r"'b' is torch.float32 \(3,\), its spec torch.float32 \(2,\)"),
    ([torch.zeros(4), torch.zeros(2, dtype=torch.float16)], "'b' is torch.float16"),
    ([torch.zeros(4)], "ended before 'b'"),
    ([torch.zeros(4), torch.zeros(2), torch.zeros(1)], "more tensors than the 2 specs"),
])
def test_pack_stream_refuses_tensors_unlike_their_specs(tensors: list[torch.Tensor], error: str) -> None:
    specs = [("a", (4,), torch.float32), ("b", (2,), torch.float32)]
    with pytest.raises(InvalidArgument, match=error):
        list(pack_stream(specs, iter(tensors), 1 << 20))


def _pairs(named: list[tuple[str, torch.Tensor]]) -> list[tuple]:
    metas, _ = plan_bucket(0, named)
    return sorted(zip(metas, [t for _, t in named], strict=True), key=lambda p: p[0].offset)


def _bucket_bytes(named: list[tuple[str, torch.Tensor]]) -> bytes:
    metas, nbytes = plan_bucket(0, named)
    out = torch.zeros(nbytes, dtype=torch.uint8)
    pack_into(out, named, metas)
    return out.numpy().tobytes()


def test_storage_runs_make_one_view_of_a_packed_bucket_and_a_run_per_loose_tensor() -> None:
    named = mixed_bucket(4)
    packed = pack_bucket(named)
    runs = storage_runs(_pairs(packed))
    assert len(runs) == 1 and runs[0][0] == 0
    assert runs[0][1].data_ptr() == packed[0][1].untyped_storage().data_ptr()  # a view, no copy
    assert runs[0][1].numpy().tobytes() == _bucket_bytes(named)
    loose = storage_runs(_pairs(named))
    assert len(loose) == sum(1 for _, t in named if t.numel())  # the empty tensor adds no run
    assert b"".join(r.numpy().tobytes() for _, r in loose) == _bucket_bytes(named)
    assert [o for o, _ in loose] == list(itertools.accumulate([0] + [r.numel() for _, r in loose[:-1]]))


def test_storage_runs_join_only_neighbours_that_lie_back_to_back_in_one_storage() -> None:
    buf = torch.arange(64, dtype=torch.uint8)
    a, b, c = buf[0:16].view(torch.float32), buf[16:32].view(torch.float32), buf[40:56].view(torch.float32)
    other = torch.arange(16, dtype=torch.uint8).view(torch.float32)
    named = [("a", a), ("b", b), ("c", c), ("x", other)]  # all fp32: layout order = input order
    runs = storage_runs(_pairs(named))
    assert [(o, r.numel()) for o, r in runs] == [(0, 32), (32, 16), (48, 16)]  # a+b; c (a gap before it); x
    assert b"".join(r.numpy().tobytes() for _, r in runs) == _bucket_bytes(named)
    swapped = [("b", b), ("a", a)]  # in one storage, but not in layout order
    assert [r.numel() for _, r in storage_runs(_pairs(swapped))] == [16, 16]


def test_a_packed_bucket_pickles_its_buffer_once_and_comes_back_equal() -> None:
    named = [(f"w{i}", torch.randn(256, 64)) for i in range(8)] + [("e", torch.zeros(0, 3)), ("h", torch.randn(5).half())]
    packed = pack_bucket(named)
    nbytes = plan_bucket(0, named)[1]
    views_pickled = len(pickle.dumps(packed, protocol=5))
    assert views_pickled > 5 * nbytes  # why the wire form exists: torch pickles a view's whole storage
    wire = pickle.dumps(to_wire(packed), protocol=5)
    assert nbytes < len(wire) < nbytes + 4096
    back = from_wire(pickle.loads(wire))
    assert [n for n, _ in back] == [n for n, _ in named]
    assert all(b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t) for (_, b), (_, t) in zip(back, named, strict=True))
    loose = [(n, t.clone()) for n, t in named]
    assert to_wire(loose) is loose and from_wire(loose) is loose  # not one storage: unchanged


def test_the_wire_form_of_part_of_a_storage_carries_only_that_part() -> None:
    big = torch.randn(1 << 14)
    named = [("a", big[250:350]), ("b", big[350:400])]
    wire = to_wire(named)
    assert len(pickle.dumps(wire)) < 2000
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(from_wire(wire), named, strict=True))
