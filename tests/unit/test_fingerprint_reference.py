"""The bucket fingerprint against its definition (services/weights/layout.py's docstring),
computed word by word in plain Python: every vectorized path (numpy `Fingerprinter` over pieces
at any offset, the torch path of `fingerprint_columns_async`, the object_store's split over
threads) must give the same digest, and the digests of fixed inputs must not change (publishers
and consumers of different builds compare them)."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.weights import layout
from services.weights.layout import (
    FINGERPRINT_COLUMNS,
    Fingerprinter,
    digest_columns,
    fingerprint_bytes,
    fingerprint_columns_async,
)
from services.weights.transports import object_store as osx

MASK = (1 << 64) - 1


def reference(data: bytes) -> str:
    """The definition: little-endian 64-bit words (zero padded), column sums mod 2^64 by word
    index mod K, mixed with the fixed odd constants and the byte length."""
    padded = data + bytes(-len(data) % 8)
    cols = [0] * FINGERPRINT_COLUMNS
    for i in range(len(padded) // 8):
        c = i % FINGERPRINT_COLUMNS
        cols[c] = (cols[c] + int.from_bytes(padded[8 * i : 8 * i + 8], "little")) & MASK
    a = sum(c * m for c, m in zip(cols, layout._MIX_A, strict=False)) + len(data) * layout._MIX_A[-1]
    b = sum(c * m for c, m in zip(cols, layout._MIX_B, strict=False)) + len(data) * layout._MIX_B[-1]
    return f"{a & MASK:016x}{b & MASK:016x}"


# sizes that cross several rows of K words, and cuts at any byte (unaligned heads and tails)
_ROW = FINGERPRINT_COLUMNS * 8
sizes = st.integers(min_value=0, max_value=4 * _ROW + 37)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=sizes, seed=st.integers(0, 2**32 - 1), cuts=st.lists(st.floats(0, 1), max_size=6), data=st.data())
def test_pieces_in_any_order_give_the_reference_digest(n: int, seed: int, cuts: list[float], data: st.DataObject) -> None:
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = reference(raw)
    assert fingerprint_bytes(raw) == want
    bounds = sorted({0, n, *(int(c * n) for c in cuts)})
    pieces = list(itertools.pairwise(bounds))
    order = data.draw(st.permutations(pieces))
    fp = Fingerprinter(n)
    for a, b in order:
        fp.update(a, raw[a:b])
    assert fp.hexdigest() == want


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(min_value=layout._FOLD * _ROW - 9, max_value=(2 * layout._FOLD + 3) * _ROW + 37),
       seed=st.integers(0, 2**32 - 1), cuts=st.lists(st.floats(0, 1), max_size=4))
def test_long_pieces_give_the_reference_digest(n: int, seed: int, cuts: list[float]) -> None:
    """Pieces long enough for the wide rows (_FOLD rows of K words summed at once, then folded),
    starting at any column and byte (wide rows from the first one on, so that short inputs take
    that path: the default waits for _WIDE_MIN_ROWS of them)."""
    layout_min_rows = layout._WIDE_MIN_ROWS
    layout._WIDE_MIN_ROWS = 1
    try:
        _check_pieces(n, seed, cuts)
    finally:
        layout._WIDE_MIN_ROWS = layout_min_rows


def _check_pieces(n: int, seed: int, cuts: list[float]) -> None:
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = reference(raw)
    bounds = sorted({0, n, *(int(c * n) for c in cuts)})
    fp = Fingerprinter(n)
    for a, b in itertools.pairwise(bounds):
        fp.update(a, raw[a:b])
    assert fp.hexdigest() == want == fingerprint_bytes(raw)


@settings(max_examples=30, deadline=None)
@given(n=sizes, seed=st.integers(0, 2**32 - 1))
def test_the_torch_columns_give_the_reference_digest(n: int, seed: int) -> None:
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    buf = torch.zeros(n + 8, dtype=torch.uint8)
    buf[:n] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if n else buf[:0]
    assert digest_columns(layout._device_columns(buf, n), n) == reference(raw)
    assert digest_columns(fingerprint_columns_async(buf, n).tolist(), n) == reference(raw)


@settings(max_examples=30, deadline=None)
@given(sizes_=st.lists(st.integers(1, 2 * _ROW + 11), min_size=1, max_size=5), threads=st.integers(1, 4),
       seed=st.integers(0, 2**32 - 1))
def test_the_object_store_split_over_threads_gives_the_reference_digest(sizes_: list[int], threads: int,
                                                                         seed: int) -> None:
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes_]
    pairs, offset = [], 0
    for a in arrays:
        pairs.append((offset, a))
        offset += a.nbytes
    got = asyncio.run(osx._fingerprint(offset, pairs, threads))
    assert got == reference(np.concatenate(arrays).tobytes())


def test_digests_of_fixed_inputs_do_not_change() -> None:
    data = bytes((i * 131 + 7) % 256 for i in range(10499))
    assert reference(data) == "911c239f8e46deaa80541b338d3f7500"
    assert fingerprint_bytes(data) == "911c239f8e46deaa80541b338d3f7500"
    assert fingerprint_bytes(data[:8144]) == "bdd7eda6816b012a25893785e70625be"
    assert fingerprint_bytes(data[:13]) == "eed8f17e945cd47109239d4f721a61c7"
    assert fingerprint_bytes(b"") == "0" * 32


def test_a_piece_past_the_threshold_takes_wide_rows_with_the_same_digest(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """At the default threshold (~8 MB) the wide rows give what rows of K give (those are checked
    against the definition above)."""
    n = layout._WIDE_MIN_ROWS * layout._FOLD * _ROW + 12345
    raw = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)

    def digest() -> str:  # the long piece starts mid-word and mid-row: a head, a lead, then rows
        fp = Fingerprinter(n)
        fp.update(0, raw[:5])
        fp.update(5, raw[5:])
        return fp.hexdigest()

    wide = digest()
    monkeypatch.setattr(layout, "_WIDE_MIN_ROWS", 10**9)
    assert digest() == wide == fingerprint_bytes(raw)
