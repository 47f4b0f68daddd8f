"""Packing buckets into one buffer, the packer's fingerprint, and the wire form a bucket crosses
processes in (services/weights/packing.py)."""

from __future__ import annotations

import itertools
import pickle
import random
from collections.abc import Iterator

import pytest
import torch

from services.common.errors import InvalidArgument
from services.weights.layout import Fingerprinter, fingerprint_bytes, group_by_bytes, pack_into, plan_bucket
from services.weights.packing import (
    PackedBucket,
    WireBucket,
    from_wire,
    known_fingerprint,
    offset_columns,
    pack_bucket,
    pack_stream,
    storage_runs,
    to_wire,
)
from tests.unit.test_param_server_layout import mixed_bucket


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


def _equal(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True))


def test_a_packed_bucket_pickles_its_buffer_once_and_comes_back_equal_with_its_fingerprint() -> None:
    named = [(f"w{i}", torch.randn(256, 64)) for i in range(8)] + [("e", torch.zeros(0, 3)), ("h", torch.randn(5).half())]
    packed = pack_bucket(named)
    nbytes = plan_bucket(0, named)[1]
    views_pickled = len(pickle.dumps(list(packed), protocol=5))
    assert views_pickled > 5 * nbytes  # why the wire form exists: torch pickles a view's whole storage
    wire = pickle.dumps(to_wire(packed), protocol=5)
    assert nbytes < len(wire) < nbytes + 4096
    back = from_wire(pickle.loads(wire))
    assert _equal(back, named)
    assert isinstance(back, PackedBucket) and back.fingerprint == packed.fingerprint
    assert known_fingerprint(back, plan_bucket(0, back)[0], nbytes) == packed.fingerprint


def test_the_wire_form_travels_out_of_band_and_is_read_back_without_a_copy() -> None:
    """As Ray pickles (protocol 5 with a buffer callback): the bytes leave the pickle as one buffer
    per run, and the tensors read back are views of that buffer."""
    packed = pack_bucket(mixed_bucket(7))
    buffers: list[pickle.PickleBuffer] = []
    inband = pickle.dumps(to_wire(packed), protocol=5, buffer_callback=buffers.append)
    assert len(inband) < 4096 and [memoryview(b).nbytes for b in buffers] == [packed.buffer.numel()]
    back = from_wire(pickle.loads(inband, buffers=buffers))
    assert _equal(back, packed)
    assert isinstance(back, PackedBucket) and back.buffer.data_ptr() == packed.buffer.data_ptr()


def test_a_loose_bucket_travels_as_one_array_per_tensor_and_a_device_bucket_unchanged() -> None:
    named = [*mixed_bucket(3), ("transposed", torch.randn(40, 6).t())]
    buffers: list[pickle.PickleBuffer] = []
    wire = to_wire(named)
    assert isinstance(wire, WireBucket) and not wire.fingerprint  # nobody fingerprinted it
    inband = pickle.dumps(wire, protocol=5, buffer_callback=buffers.append)
    assert len(inband) < 4096 and len(buffers) == sum(1 for _, t in named if t.numel())
    back = from_wire(pickle.loads(inband, buffers=buffers))
    assert _equal(back, named) and not isinstance(back, PackedBucket)
    on_device = [("w", torch.empty(4, device="meta"))]
    assert to_wire(on_device) is on_device and from_wire(on_device) is on_device


def test_the_wire_form_of_part_of_a_storage_carries_only_that_part() -> None:
    big = torch.randn(1 << 14)
    named = [("a", big[250:350]), ("b", big[350:400])]
    wire = to_wire(named)
    assert len(pickle.dumps(wire)) < 2000
    assert _equal(from_wire(pickle.loads(pickle.dumps(wire))), named)


def test_the_packers_fingerprint_is_the_fingerprint_of_the_buffer() -> None:
    for seed in range(4):  # bf16 and int8 tensors of odd lengths: tensors share words, offsets not aligned
        packed = pack_bucket(mixed_bucket(seed))
        assert packed.fingerprint == fingerprint_bytes(packed.buffer.numpy())
    streamed = list(pack_stream([(f"t{i}", (i + 3,), torch.bfloat16) for i in range(9)],
                                (torch.randn(i + 3).bfloat16() for i in range(9)), 24))
    assert len(streamed) > 1 and all(b.fingerprint == fingerprint_bytes(b.buffer.numpy()) for b in streamed)


def test_offset_columns_of_tensors_tiling_a_buffer_add_up_to_its_fingerprint() -> None:
    """The sums pack_stream takes on an accelerator, per tensor at its offset (computed here on the
    host: the same torch code; tests/gpu runs it on CUDA)."""
    rng = random.Random(5)
    for _ in range(20):
        lengths = [rng.choice([0, 1, 3, 7, 8, 9, 509 * 8 + 5, rng.randrange(1, 9000)]) for _ in range(rng.randrange(1, 6))]
        data = torch.randint(0, 256, (sum(lengths),), dtype=torch.uint8)
        fp = Fingerprinter(data.numel())
        for start, n in zip(itertools.accumulate([0, *lengths]), lengths, strict=False):
            fp.add_columns(offset_columns(data[start : start + n].clone(), start))
        assert fp.hexdigest() == fingerprint_bytes(data.numpy()), lengths


def test_a_fingerprint_is_known_only_while_the_bucket_is_its_buffer_in_its_layout() -> None:
    packed = pack_bucket(mixed_bucket(1))
    metas, nbytes = plan_bucket(0, packed)
    assert known_fingerprint(packed, metas, nbytes) == packed.fingerprint
    assert known_fingerprint(list(packed), metas, nbytes) is None  # a plain list: nobody vouches for it
    replaced = PackedBucket(packed, packed.buffer, packed.fingerprint)
    replaced[0] = (replaced[0][0], replaced[0][1].clone())  # same values, other memory
    assert known_fingerprint(replaced, metas, nbytes) is None
    reordered = PackedBucket(packed[::-1], packed.buffer, packed.fingerprint)
    assert known_fingerprint(reordered, plan_bucket(0, reordered)[0], nbytes) is None
    assert known_fingerprint(packed, metas, nbytes + 8) is None


@pytest.mark.gpu
def test_pack_stream_from_cuda_takes_the_fingerprint_on_the_device_and_it_matches_the_host_bytes() -> None:
    """The FSDP export's case: gathered parameters on the GPU packed into a host buffer, the
    fingerprint summed on the GPU per tensor (offset_columns) before each copy, none read on the
    host; and a buffer on the GPU itself, summed there at the end. Both equal the host
    fingerprint of the bytes that arrived."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for seed in range(3):
        named = [(n, t.cuda()) for n, t in mixed_bucket(seed)] + [("big", torch.randn(1 << 20, device="cuda").bfloat16())]
        host = pack_bucket(named)
        assert host.buffer.device.type == "cpu"
        assert host.fingerprint == fingerprint_bytes(host.buffer.numpy())
        assert _equal([(n, t.cpu()) for n, t in named], host)
        on_device = pack_bucket(named, device="cuda")
        assert on_device.buffer.device.type == "cuda" and on_device.fingerprint == host.fingerprint
    data = torch.randint(0, 256, (100_003,), dtype=torch.uint8)
    for offset, n in ((0, 100_003), (3, 77_777), (8 * 509 + 5, 1234)):
        assert torch.equal(offset_columns(data[:n].cuda(), offset).cpu(), offset_columns(data[:n], offset))


@pytest.mark.gpu
def test_a_staged_copy_from_cuda_is_the_direct_copy_byte_for_byte() -> None:
    """The pinned stage (packing.STAGE_BYTES at a time): a tensor over two stages long at an odd
    offset, a transposed (non-contiguous) one and one under STAGE_MIN_BYTES (copied directly)
    arrive as the direct copy brings them, with the same fingerprint."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from services.weights import packing

    g = torch.Generator(device="cuda").manual_seed(3)
    long = torch.randint(0, 256, (2 * packing.STAGE_BYTES + 12_345,), dtype=torch.uint8, device="cuda", generator=g)
    named = [("odd", torch.arange(3, dtype=torch.uint8, device="cuda")), ("long", long),
             ("transposed", torch.randn(1024, 700, device="cuda", generator=g).t()),
             ("small", torch.randn(1000, device="cuda", generator=g).bfloat16())]
    staged, direct = pack_bucket(named), pack_bucket(named, staged=False)
    assert torch.equal(staged.buffer, direct.buffer) and staged.fingerprint == direct.fingerprint
    assert staged.fingerprint == fingerprint_bytes(staged.buffer.numpy())
    assert _equal([(n, t.cpu()) for n, t in named], staged)
