"""How a weight version is laid out in bytes, and how those bytes are checked. No Ray, no gRPC.

A version is a list of buckets (the trainer's `export_weights(bucket_bytes)` batches); a bucket is
one contiguous byte string holding its tensors back to back:

    bucket 0: [ w_q (bf16) | w_k (bf16) | norm (fp32) ... ]   offsets in TensorMeta.offset
    bucket 1: [ ... ]

Inside a bucket the tensors are ordered by element size, largest first (stable otherwise), so
every offset is a multiple of its tensor's element size without any padding: a bucket can be
viewed as typed tensors in place (zero copy) and is byte for byte the data section of a
safetensors file (the `disk` transport writes exactly that).

Checks. Every bucket carries a fingerprint: 128 bits over its bytes read as little-endian 64-bit
words w_i (zero padded to whole words), from the K column sums S[c] = sum of w_i with i = c mod K
(mod 2^64), mixed with fixed odd constants and the byte length. It is not cryptographic; it
catches a flipped bit, lost or stale regions, truncation and shifted blocks (K = 509 is prime, so
swapping power-of-two sized blocks moves words to other columns). Its blind spots come from the
mix being linear mod 2^64: a change of d x 2^(64-j) in a column sum (d odd) reaches the digest
only through the low j bits of that column's constants. So flips of bit 63 of an even number of
words (the sign bit of every 4th bf16 / 2nd fp32 element) always pass unseen, and the same high
bit flipped in two words of different columns passes for a share of the column pairs: bit 62 (the
top exponent bit of those elements) for about 1 in 4, bit 61 for 1 in 16, each lower bit 4x
fewer (tests/unit/test_param_server_layout.py measures it). The collective transports compare the
column sums themselves, which leaves only changes that cancel within one column (two bit-63 flips
there, two words K apart swapped). Random damage (torn reads, lost chunks, a flipped bit) does
not take that shape; a fault that flips one bit position in many words (a bad data line) can:
where any corruption must be caught, turn on `param_server.bucket_sha256`. (A versioned
fingerprint that mixes each column sum non-linearly before the sum would close all but the
within-column ones; it changes `digest_columns` only, not the column sums or their device
kernels.) It runs at memory speed and, being sums, is the same whether computed in one pass on a
device (`fingerprint_tensor`, torch) or incrementally over chunks in any order (`Fingerprinter`, numpy). A sha256 per bucket is optional
(`param_server.bucket_sha256`); it costs ~1.5 GB/s of one core. The manifest checksum (sha256 over
all metadata and bucket checks) names a version's content exactly.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np
import torch

from services.common.errors import DataLoss, InvalidArgument

from .adapter import AdapterSpec

FINGERPRINT_COLUMNS = 509
_MASK64 = (1 << 64) - 1
_FOLD = 64  # rows of the host column sum: _FOLD * FINGERPRINT_COLUMNS words (see Fingerprinter)
_WIDE_MIN_ROWS = 32  # ... for pieces of at least this many such rows (~8 MB)

# torch dtype -> (meshrl.v1.DType value, safetensors name). Values match param_server.proto.
_DTYPES: dict[torch.dtype, tuple[int, str]] = {
    torch.float32: (1, "F32"),
    torch.float16: (2, "F16"),
    torch.bfloat16: (3, "BF16"),
    torch.float64: (4, "F64"),
    torch.int64: (5, "I64"),
    torch.int32: (6, "I32"),
    torch.int8: (7, "I8"),
    torch.uint8: (8, "U8"),
    torch.bool: (9, "BOOL"),
    torch.float8_e4m3fn: (10, "F8_E4M3"),
    torch.float8_e5m2: (11, "F8_E5M2"),
}
_BY_PROTO = {code: dt for dt, (code, _) in _DTYPES.items()}
_BY_SAFETENSORS = {name: dt for dt, (_, name) in _DTYPES.items()}


def dtype_to_proto(dtype: torch.dtype) -> int:
    try:
        return _DTYPES[dtype][0]
    except KeyError:
        raise InvalidArgument(
            "dtype", f"{dtype} cannot travel as weights (supported: {sorted(str(d) for d in _DTYPES)}); cast it"
        ) from None


def dtype_from_proto(code: int) -> torch.dtype:
    try:
        return _BY_PROTO[code]
    except KeyError:
        raise InvalidArgument("manifest.tensors.dtype", f"unknown DType value {code}") from None


def safetensors_dtype(dtype: torch.dtype) -> str:
    dtype_to_proto(dtype)  # raises for unsupported dtypes
    return _DTYPES[dtype][1]


def dtype_from_safetensors(name: str) -> torch.dtype:
    try:
        return _BY_SAFETENSORS[name]
    except KeyError:
        raise InvalidArgument("safetensors dtype", f"{name!r} is not a weight dtype meshrl carries") from None


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives: bucket and byte range inside it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bucket_index: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketMeta:
    """Size and checks of one bucket's bytes."""

    index: int
    nbytes: int
    fingerprint: str
    sha256: str = ""


@dataclass(frozen=True)
class Manifest:
    """A version's full description. `checksum` covers everything except `transports` and time."""

    policy_version: int
    tensors: tuple[TensorMeta, ...]
    buckets: tuple[BucketMeta, ...]
    total_bytes: int
    checksum: str
    created_unix_s: float = 0.0
    transports: tuple[str, ...] = field(default=())
    adapter: AdapterSpec | None = None
    """Set for an adapter-only (LoRA) version: read from its descriptor tensor (adapter.py),
    which the checksum covers through its bucket's fingerprint."""

    def bucket_tensors(self, index: int) -> list[TensorMeta]:
        return [t for t in self.tensors if t.bucket_index == index]

    def buckets_for_names(self, names: Iterable[str]) -> list[int]:
        """Indices of the buckets holding any of `names` (raises for unknown names)."""
        wanted = set(names)
        by_name = {t.name: t.bucket_index for t in self.tensors}
        unknown = sorted(wanted - by_name.keys())
        if unknown:
            raise InvalidArgument("names", f"not in version {self.policy_version}: {unknown[:5]}")
        return sorted({by_name[n] for n in wanted})

    def with_transports(self, transports: Iterable[str]) -> Manifest:
        return replace(self, transports=tuple(sorted(set(self.transports) | set(transports))))


# ---- layout -------------------------------------------------------------------------------------


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def group_by_bytes(named: Iterable[tuple[str, torch.Tensor]],
                   max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of (name, tensor) of at most `max_bytes` each, a larger tensor alone;
    lazy: a run is yielded before the next tensor is asked for."""
    run: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = tensor_nbytes(t)
        if run and size + n > max_bytes:
            yield run
            run, size = [], 0
        run.append((name, t))
        size += n
    if run:
        yield run


def plan_bucket(index: int, named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    """Offsets for a bucket's tensors (element size descending, input order otherwise). Returns
    the metas in input order and the bucket's byte size."""
    order = sorted(range(len(named)), key=lambda i: -named[i][1].element_size())
    offsets: dict[int, int] = {}
    pos = 0
    for i in order:
        offsets[i] = pos
        pos += tensor_nbytes(named[i][1])
    metas = []
    seen: set[str] = set()
    for i, (name, t) in enumerate(named):
        if name in seen:
            raise InvalidArgument("buckets", f"tensor {name!r} appears twice")
        seen.add(name)
        dtype_to_proto(t.dtype)
        metas.append(TensorMeta(name, t.dtype, tuple(int(s) for s in t.shape), index, offsets[i], tensor_nbytes(t)))
    return metas, pos


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of `t` (copied first if not contiguous)."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def pack_into(out: torch.Tensor, named: Sequence[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta]) -> None:
    """Copy a bucket's tensors into `out` (uint8, any device) at their offsets: one concatenation
    when they all live on `out`'s device and tile it back to back (as plan_bucket lays them out),
    else a copy per tensor."""
    pairs = sorted(zip(named, metas, strict=True), key=lambda p: p[1].offset)
    if len(pairs) > 1 and all(t.device == out.device for (_, t), _ in pairs) and all(
        a[1].offset + a[1].nbytes == b[1].offset for a, b in itertools.pairwise(pairs)
    ):
        start, end = pairs[0][1].offset, pairs[-1][1].offset + pairs[-1][1].nbytes
        torch.cat([as_bytes(t) for (_, t), _ in pairs], out=out[start:end])
        return
    for (_, t), m in zip(named, metas, strict=True):
        if m.nbytes:
            out[m.offset : m.offset + m.nbytes].copy_(as_bytes(t), non_blocking=True)


def unpack(buffer: torch.Tensor, metas: Iterable[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Typed views of a bucket's tensors inside `buffer` (uint8, starting at the bucket's byte 0)."""
    out = []
    for m in metas:
        raw = buffer[m.offset : m.offset + m.nbytes]
        out.append((m.name, raw.view(m.dtype).view(m.shape)))
    return out


def host_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a memoryview (no copy)."""
    return memoryview(cast(Any, t.numpy())).cast("B")


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


# ---- fingerprint --------------------------------------------------------------------------------


def _splitmix64(seed: int, count: int) -> list[int]:
    out, x = [], seed
    for _ in range(count):
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append((z ^ (z >> 31)) | 1)
    return out


_MIX_A = _splitmix64(0x6D657368726C0001, FINGERPRINT_COLUMNS + 1)
_MIX_B = _splitmix64(0x6D657368726C0002, FINGERPRINT_COLUMNS + 1)
_MIX_A_NP = np.array(_MIX_A[:FINGERPRINT_COLUMNS], dtype=np.uint64)
_MIX_B_NP = np.array(_MIX_B[:FINGERPRINT_COLUMNS], dtype=np.uint64)


def digest_columns(columns: Sequence[int] | np.ndarray | torch.Tensor, nbytes: int) -> str:
    """The hex fingerprint from K column sums (any ints; taken mod 2^64) and the byte length.
    Vectorized: uint64 products and sums wrap mod 2^64, as the definition does."""
    if isinstance(columns, torch.Tensor):
        cols = columns.numpy().view(np.uint64) if columns.dtype == torch.int64 else columns.numpy().astype(np.uint64)
    elif isinstance(columns, np.ndarray):
        cols = columns.view(np.uint64) if columns.dtype in (np.int64, np.uint64) else columns.astype(np.uint64)
    else:
        cols = np.array([c & _MASK64 for c in columns], dtype=np.uint64)
    assert cols.shape == (FINGERPRINT_COLUMNS,)
    with np.errstate(over="ignore"):
        a = int((cols * _MIX_A_NP).sum(dtype=np.uint64)) + nbytes * _MIX_A[-1]
        b = int((cols * _MIX_B_NP).sum(dtype=np.uint64)) + nbytes * _MIX_B[-1]
    return f"{a & _MASK64:016x}{b & _MASK64:016x}"


class Fingerprinter:
    """Incremental fingerprint over pieces of a byte string given with their offsets, in any order
    (pieces must not overlap). numpy, host memory; runs at memory bandwidth."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._cols = np.zeros(FINGERPRINT_COLUMNS, dtype=np.uint64)

    def update(self, offset: int, data: object) -> None:
        mv = memoryview(data).cast("B")  # type: ignore[arg-type]
        n = len(mv)
        if offset < 0 or offset + n > self.nbytes:
            raise DataLoss(f"piece [{offset}, {offset + n}) outside the bucket's {self.nbytes} bytes")
        head = min(n, (-offset) % 8)
        if head:
            self._add_partial(offset, mv[:head])
        body = (n - head) // 8
        if body:
            words = np.frombuffer(mv, dtype="<u8", count=body, offset=head)
            self._add_words((offset + head) // 8, words)
        tail_start = head + body * 8
        if tail_start < n:
            self._add_partial(offset + tail_start, mv[tail_start:])

    def _add_partial(self, offset: int, piece: memoryview) -> None:
        # Bytes of one word: byte b at position p adds b * 256^(p % 8) to that word's column.
        word = offset // 8
        value = int.from_bytes(bytes(piece), "little") << (8 * (offset % 8))
        col = word % FINGERPRINT_COLUMNS
        self._cols[col] = np.uint64((int(self._cols[col]) + value) & _MASK64)

    def _add_words(self, first_word: int, words: np.ndarray) -> None:
        k = FINGERPRINT_COLUMNS
        start = first_word % k
        lead = min(len(words), (k - start) % k)
        if lead:
            self._cols[start : start + lead] += words[:lead]
        rest = words[lead:]  # rest[i] lands in column i % k
        # Long pieces in rows of k * _FOLD words first, each row's sum folded into k columns after:
        # numpy sums wide rows faster; on short pieces the extra reduction costs more than it saves
        # (BENCHMARKS.md, "A faster host kernel")
        wide = len(rest) // (k * _FOLD) * (k * _FOLD) if len(rest) >= _WIDE_MIN_ROWS * k * _FOLD else 0
        if wide:
            self._cols += rest[:wide].reshape(-1, k * _FOLD).sum(axis=0, dtype=np.uint64).reshape(_FOLD, k).sum(
                axis=0, dtype=np.uint64)
        full = len(rest) // k * k
        if full > wide:
            self._cols += rest[wide:full].reshape(-1, k).sum(axis=0, dtype=np.uint64)
        tail = rest[full:]
        if len(tail):
            self._cols[: len(tail)] += tail

    def merge(self, other: Fingerprinter) -> None:
        """Add the pieces `other` saw (same byte string, pieces not overlapping this one's): the
        columns are sums, so pieces fingerprinted in parallel threads combine exactly."""
        if other.nbytes != self.nbytes:
            raise InvalidArgument("other.nbytes", f"{other.nbytes} != {self.nbytes}: not pieces of the same bytes")
        self._cols += other._cols

    def add_columns(self, columns: torch.Tensor) -> None:
        """Add the K column sums (int64, any device) of pieces this one has not seen, computed
        elsewhere: `offset_columns` on the device a tensor lives on."""
        self._cols += columns.cpu().numpy().view(np.uint64)

    def hexdigest(self) -> str:
        return digest_columns(self._cols, self.nbytes)

    def columns(self) -> torch.Tensor:
        """The K column sums as an int64 tensor (what `fingerprint_columns_async` returns)."""
        return torch.from_numpy(self._cols.view(np.int64).copy())


def fingerprint_bytes(data: object, nbytes: int | None = None) -> str:
    """Fingerprint of one contiguous host buffer."""
    mv = memoryview(data).cast("B")  # type: ignore[arg-type]
    fp = Fingerprinter(len(mv) if nbytes is None else nbytes)
    fp.update(0, mv if nbytes is None else mv[:nbytes])
    return fp.hexdigest()


def fingerprint_tensor(buffer: torch.Tensor, nbytes: int) -> str:
    """Fingerprint of `buffer[:nbytes]` (uint8, any device; bytes up to the next multiple of 8
    must be zero). On an accelerator this is one reduction kernel plus a 4 KiB copy."""
    if buffer.device.type == "cpu":
        return fingerprint_bytes(buffer.numpy(), nbytes)
    return digest_columns(_device_columns(buffer, nbytes).cpu(), nbytes)


def fingerprint_columns_async(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The K column sums of `buffer[:nbytes]` as an int64 device tensor, enqueued on the current
    stream without a host sync (finish with `digest_columns(result.tolist(), nbytes)`). On CPU it
    is computed at once (numpy: ~3x faster there than torch's reduction)."""
    if buffer.device.type == "cpu":
        fp = Fingerprinter(nbytes)
        fp.update(0, buffer[:nbytes].numpy())
        return fp.columns()
    return _device_columns(buffer, nbytes)


def tensor_columns(t: torch.Tensor) -> torch.Tensor:
    """The K column sums of one tensor's bytes (any length, any offset), as an int64 tensor on its
    device: enqueued without a host sync on an accelerator, computed at once on the CPU. Equal
    tensors give equal columns on every device (delta sync checks rebuilt tensors with them)."""
    raw = as_bytes(t)
    n = raw.numel()
    if t.device.type == "cpu":
        fp = Fingerprinter(n)
        fp.update(0, raw.numpy())
        return fp.columns()
    full = n // 8 * 8
    if raw.storage_offset() % 8:
        raw = raw.clone()  # an int64 view needs 8-byte alignment
    cols = _device_columns(raw, full) if full else torch.zeros(FINGERPRINT_COLUMNS, dtype=torch.int64, device=t.device)
    if n > full:
        tail = torch.zeros(8, dtype=torch.uint8, device=t.device)
        tail[: n - full] = raw[full:]
        cols[(full // 8) % FINGERPRINT_COLUMNS] += tail.view(torch.int64)[0]
    return cols


def _device_columns(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    k = FINGERPRINT_COLUMNS
    words = buffer[: round_up(nbytes, 8)].view(torch.int64)
    full = words.numel() // k * k
    cols = torch.zeros(k, dtype=torch.int64, device=buffer.device)
    if full:
        cols += words[:full].view(-1, k).sum(dim=0)
    tail = words[full:]
    if tail.numel():
        cols[: tail.numel()] += tail
    return cols


# ---- manifests ----------------------------------------------------------------------------------


def manifest_checksum(
    policy_version: int, tensors: Iterable[TensorMeta], buckets: Iterable[BucketMeta]
) -> str:
    """sha256 over a canonical JSON of the content-defining fields."""
    doc = {
        "policy_version": policy_version,
        "tensors": [
            [t.name, dtype_to_proto(t.dtype), list(t.shape), t.bucket_index, t.offset, t.nbytes] for t in tensors
        ],
        "buckets": [[b.index, b.nbytes, b.fingerprint, b.sha256] for b in buckets],
    }
    return hashlib.sha256(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def build_manifest(
    policy_version: int,
    tensors: Sequence[TensorMeta],
    buckets: Sequence[BucketMeta],
    *,
    created_unix_s: float = 0.0,
    transports: Iterable[str] = (),
    adapter: AdapterSpec | None = None,
) -> Manifest:
    return Manifest(
        policy_version=policy_version,
        tensors=tuple(tensors),
        buckets=tuple(buckets),
        total_bytes=sum(b.nbytes for b in buckets),
        checksum=manifest_checksum(policy_version, tensors, buckets),
        created_unix_s=created_unix_s,
        transports=tuple(sorted(set(transports))),
        adapter=adapter,
    )


def validate_manifest(m: Manifest) -> None:
    """Structural checks a receiver relies on; raises InvalidArgument naming what is wrong."""
    if m.policy_version < 0:
        raise InvalidArgument("manifest.policy_version", f"must be >= 0, got {m.policy_version}")
    for i, b in enumerate(m.buckets):
        if b.index != i:
            raise InvalidArgument("manifest.buckets", f"bucket #{i} has index {b.index}; indices must be 0..n-1 in order")
        if not b.fingerprint:
            raise InvalidArgument("manifest.buckets.fingerprint", f"bucket {i} has no fingerprint")
    if m.total_bytes != sum(b.nbytes for b in m.buckets):
        raise InvalidArgument("manifest.total_bytes", f"{m.total_bytes} != sum of bucket sizes")
    names: set[str] = set()
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in m.tensors:
        if t.name in names:
            raise InvalidArgument("manifest.tensors", f"tensor {t.name!r} appears twice")
        names.add(t.name)
        if not 0 <= t.bucket_index < len(m.buckets):
            raise InvalidArgument("manifest.tensors.bucket_index", f"{t.name}: bucket {t.bucket_index} does not exist")
        itemsize = t.dtype.itemsize
        numel = 1
        for s in t.shape:
            numel *= s
        if t.nbytes != numel * itemsize:
            raise InvalidArgument("manifest.tensors.nbytes", f"{t.name}: {t.nbytes} bytes for shape {t.shape} {t.dtype}")
        if t.offset % itemsize:
            raise InvalidArgument("manifest.tensors.offset", f"{t.name}: offset {t.offset} not a multiple of {itemsize}")
        if t.offset + t.nbytes > m.buckets[t.bucket_index].nbytes:
            raise InvalidArgument("manifest.tensors.offset", f"{t.name}: ends past its bucket")
        spans.setdefault(t.bucket_index, []).append((t.offset, t.offset + t.nbytes))
    for index, ranges in spans.items():
        ranges.sort()
        for (_, end), (start, _) in itertools.pairwise(ranges):
            if start < end:
                raise InvalidArgument("manifest.tensors.offset", f"tensors overlap in bucket {index}")
    expected = manifest_checksum(m.policy_version, m.tensors, m.buckets)
    if m.checksum != expected:
        raise InvalidArgument("manifest.checksum", f"{m.checksum!r} does not match its content ({expected})")


def verify_bucket(meta: BucketMeta, *, fingerprint: str, sha256: str | None = None, nbytes: int) -> None:
    """Raise DataLoss when received bytes disagree with the manifest."""
    if nbytes != meta.nbytes:
        raise DataLoss(f"bucket {meta.index}: got {nbytes} bytes, manifest says {meta.nbytes}")
    if fingerprint != meta.fingerprint:
        raise DataLoss(f"bucket {meta.index}: fingerprint {fingerprint} != manifest {meta.fingerprint}")
    if meta.sha256 and sha256 is not None and sha256 != meta.sha256:
        raise DataLoss(f"bucket {meta.index}: sha256 {sha256} != manifest {meta.sha256}")
