"""A bucket packed into one buffer, its fingerprint taken as it is packed, and the form in which a
bucket crosses between processes. No Ray, no gRPC.

    engine export ─ pack_stream ─▶ PackedBucket: typed views of one buffer in plan_bucket's layout,
        with the buffer's fingerprint, summed as each tensor is copied in (on the tensor's own
        device when it comes from an accelerator: one reduction kernel per tensor, no host pass)
      ─ to_wire ─▶ WireBucket ─(Ray: trainer rank ─▶ trainer deployment)─▶ from_wire ─▶ PackedBucket
      ─ publisher: plan_buckets takes the packer's fingerprint (known_fingerprint) instead of
        reading every byte again

The fingerprint is the manifest's check of the bytes (layout.py); taken at the source it covers
the copy to the host as well. A bucket whose tensors are no longer its buffer's bytes in its
layout (rebuilt, reordered, partly replaced) has no known fingerprint: its publisher reads it.
"""

from __future__ import annotations

import bisect
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.common.errors import DataLoss, InvalidArgument

from .buffers import ByteBuffers
from .layout import (
    FINGERPRINT_COLUMNS,
    Fingerprinter,
    TensorMeta,
    as_bytes,
    group_by_bytes,
    plan_bucket,
    tensor_columns,
    tensor_nbytes,
    unpack,
)


class PackedBucket(list[tuple[str, torch.Tensor]]):
    """A bucket (name, tensor pairs, in input order) whose tensors are views of `buffer` (uint8,
    the whole bucket) at plan_bucket's offsets, with `fingerprint`, the buffer's fingerprint as its
    packer computed it. Nothing may write the buffer after packing: its publisher trusts the
    fingerprint instead of reading the bytes."""

    def __init__(self, views: Iterable[tuple[str, torch.Tensor]], buffer: torch.Tensor, fingerprint: str,
                 stored: Any = None) -> None:
        super().__init__(views)
        self.buffer = buffer
        self.fingerprint = fingerprint
        self.stored = stored
        """The Ray object ref this bucket was read from (its WireBucket: the buffer as one run), when
        this process owns the object and it lies in this node's store: an object_store publisher
        registers it as the bucket's object instead of writing the bytes again. None otherwise."""


def known_fingerprint(named: Sequence[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta], nbytes: int) -> str | None:
    """The packer's fingerprint of `named` laid out as `metas` say (plan_bucket's, in `named`'s
    order) over `nbytes`: when `named` is a PackedBucket whose tensors are still its buffer's bytes
    at those offsets; None otherwise (the caller reads the bytes)."""
    if not isinstance(named, PackedBucket) or not named.fingerprint or len(named) != len(metas):
        return None
    buf = named.buffer
    if buf.dtype != torch.uint8 or buf.numel() != nbytes or not buf.is_contiguous():
        return None
    base, storage = buf.data_ptr(), buf.untyped_storage().data_ptr()
    for (_, t), m in zip(named, metas, strict=True):
        if m.nbytes and not (t.device == buf.device and t.is_contiguous()
                             and t.untyped_storage().data_ptr() == storage and t.data_ptr() == base + m.offset):
            return None
    return named.fingerprint


def offset_columns(t: torch.Tensor, offset: int) -> torch.Tensor:
    """The K column sums that `t`'s bytes add to a bucket's fingerprint when they lie at byte
    `offset` of it, as an int64 tensor on `t`'s device (enqueued without a host sync on an
    accelerator). A word the tensor shares with a neighbour gets only this tensor's bytes: the
    neighbour's columns add the rest."""
    raw = as_bytes(t)
    lead = offset % 8
    if lead:  # start at the word boundary before the tensor: its first bytes keep their places in the word
        padded = torch.zeros(lead + raw.numel(), dtype=torch.uint8, device=t.device)
        padded[lead:] = raw
        raw = padded
    return torch.roll(tensor_columns(raw), (offset // 8) % FINGERPRINT_COLUMNS)


class _PackFingerprint:
    """A bucket's fingerprint as pack_stream fills its buffer: a tensor from an accelerator is
    summed there before its copy, a host tensor from its place in the host buffer after it; a
    buffer on an accelerator is summed there in one pass at the end."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.host = Fingerprinter(buffer.numel())
        self.device_columns: dict[torch.device, torch.Tensor] = {}

    def before_copy(self, t: torch.Tensor, meta: TensorMeta) -> None:
        if self.buffer.device.type == "cpu" and t.device.type != "cpu" and meta.nbytes:
            cols = offset_columns(t, meta.offset)
            acc = self.device_columns.get(t.device)
            self.device_columns[t.device] = cols if acc is None else acc + cols

    def after_copy(self, t: torch.Tensor, meta: TensorMeta) -> None:
        if self.buffer.device.type == "cpu" and t.device.type == "cpu" and meta.nbytes:
            self.host.update(meta.offset, self.buffer[meta.offset : meta.offset + meta.nbytes].numpy())

    def hexdigest(self) -> str:
        if self.buffer.device.type != "cpu":
            self.host.add_columns(tensor_columns(self.buffer))
        for cols in self.device_columns.values():
            self.host.add_columns(cols)
        return self.host.hexdigest()


STAGE_BYTES = 32 << 20
"""The pinned host buffer a CUDA tensor's bytes pass through on their way into a bucket (pageable
host memory, fresh per bucket): a copy from the GPU straight into fresh pageable memory ran at
1.3-1.4 GB/s on an H200 host, where a copy into pinned memory is a DMA at link speed and the host
copy on from there runs at memcpy speed (BENCHMARKS.md: `export`, `staging_speedup_best`)."""
STAGE_MIN_BYTES = 1 << 20
"""Smaller tensors copy directly: their pageable copy is short, a staged one two calls."""


class _PinnedStage:
    """One pinned buffer for the process, allocated on first use; a second packer while it is
    busy (another thread) copies directly."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers = ByteBuffers(1, pin=True)
        self._failed = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """dst (host uint8, contiguous, src's byte length) <- src (a CUDA tensor), STAGE_BYTES at a
        time through the pinned buffer; False (nothing copied) when the stage is not available."""
        if self._failed or not self._lock.acquire(blocking=False):
            return False
        try:
            try:
                buffer = self._buffers.get(0, STAGE_BYTES)  # allocated once, on first use
            except RuntimeError:  # no pinnable memory here (a driver without it, a locked-memory limit)
                self._failed = True
                return False
            raw = as_bytes(src)
            for off in range(0, raw.numel(), STAGE_BYTES):
                n = min(STAGE_BYTES, raw.numel() - off)
                stage = buffer[:n]
                stage.copy_(raw[off : off + n])  # into pinned memory: synchronous, the bytes are there
                dst[off : off + n].copy_(stage)
            return True
        finally:
            self._lock.release()


_STAGE = _PinnedStage()


def _copy_in(buffer: torch.Tensor, view: torch.Tensor, t: torch.Tensor, meta: TensorMeta, staged: bool) -> None:
    if (staged and buffer.device.type == "cpu" and t.device.type == "cuda" and meta.nbytes >= STAGE_MIN_BYTES
            and _STAGE.copy(buffer[meta.offset : meta.offset + meta.nbytes], t)):
        return
    view.copy_(t)


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]], device: torch.device | str = "cpu", *,
                staged: bool = True) -> PackedBucket:
    """The bucket copied into one new uint8 buffer on `device`, laid out as `plan_bucket` lays it
    out (a PackedBucket of typed views, in input order): `pack_stream` of one bucket in hand."""
    specs = [(name, tuple(t.shape), t.dtype) for name, t in named]
    packed = next(pack_stream(specs, (t for _, t in named), max(1, sum(tensor_nbytes(t) for _, t in named)), device,
                              staged=staged), None)
    if packed is None:  # no tensors
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        return PackedBucket([], empty, Fingerprinter(0).hexdigest())
    return packed


def pack_stream(specs: Sequence[tuple[str, tuple[int, ...], torch.dtype]], tensors: Iterable[torch.Tensor],
                max_bytes: int, device: torch.device | str = "cpu", *, staged: bool = True) -> Iterator[PackedBucket]:
    """Buckets grouped as `group_by_bytes` groups, each packed into one new uint8 buffer on
    `device` in `plan_bucket`'s layout (a PackedBucket of typed views of it, in input order, with
    its fingerprint), from (name, shape, dtype) known ahead and the tensors in that order: each
    tensor is copied into its place as it arrives, so the source holds one tensor at a time (a
    gathered parameter on its device is freed before the next is gathered). One copy per tensor,
    as a plain `.to(device)` of each would make, but a transport then finds a bucket's bytes in one
    piece (`storage_runs`: the object_store puts it as one buffer, and Ray copies one large buffer
    faster than many) and its fingerprint already taken. A tensor unlike its spec is refused.
    Copies block: a bucket's views are ready when it is yielded. A CUDA tensor of STAGE_MIN_BYTES or
    more bound for a host buffer goes through a pinned buffer (`staged`; False: a direct copy)."""
    specs = list(specs)
    sources = iter(tensors)
    shaped = [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, shape, dtype in specs]
    for run in group_by_bytes(shaped, max_bytes):
        metas, nbytes = plan_bucket(0, run)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        views = unpack(buffer, metas)
        fingerprint = _PackFingerprint(buffer)
        for (name, view), meta in zip(views, metas, strict=True):
            t = next(sources, None)
            if t is None:
                raise InvalidArgument("tensors", f"ended before {name!r}: one tensor per spec, in order")
            if t.shape != view.shape or t.dtype != view.dtype:
                raise InvalidArgument("tensors", f"{name!r} is {t.dtype} {tuple(t.shape)}, its spec "
                                      f"{view.dtype} {tuple(view.shape)}")
            fingerprint.before_copy(t, meta)
            _copy_in(buffer, view, t, meta, staged)
            fingerprint.after_copy(t, meta)
        yield PackedBucket(views, buffer, fingerprint.hexdigest())
    if next(sources, None) is not None:
        raise InvalidArgument("tensors", f"more tensors than the {len(specs)} specs")


def storage_runs(pairs: Sequence[tuple[TensorMeta, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """(bucket offset, flat uint8 tensor) runs covering a bucket, given its (meta, tensor) pairs in
    layout order: tensors that lie back to back in one storage (a `pack_bucket` bucket: one run)
    become one view of it, no copy; any other tensor is a run of its own (`as_bytes`, which copies
    a non-contiguous one). Empty tensors add no run. Concatenated, the runs are the bucket's bytes."""
    runs: list[tuple[int, torch.Tensor]] = []
    run: list[tuple[TensorMeta, torch.Tensor]] = []

    def close() -> None:
        if not run:
            return
        first = run[0][1]
        if len(run) == 1:
            runs.append((run[0][0].offset, as_bytes(first)))
        else:
            storage = first.untyped_storage()
            start = first.data_ptr() - storage.data_ptr()
            length = sum(m.nbytes for m, _ in run)
            runs.append((run[0][0].offset, torch.empty(0, dtype=torch.uint8, device=first.device)
                         .set_(storage, start, (length,), (1,))))
        run.clear()

    for meta, t in pairs:
        if not meta.nbytes:
            continue
        if run:
            prev_meta, prev = run[-1]
            joins = (t.is_contiguous() and prev.is_contiguous() and t.device == prev.device
                     and t.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
                     and t.data_ptr() == prev.data_ptr() + prev_meta.nbytes
                     and meta.offset == prev_meta.offset + prev_meta.nbytes)
            if not joins:
                close()
        run.append((meta, t))
    close()
    return runs


def _wire_bucket(arrays: list[tuple[int, np.ndarray]], metas: list[TensorMeta], fingerprint: str) -> WireBucket:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Ray's out-of-band buffers are read-only: so are the views
        return WireBucket([(offset, torch.from_numpy(a)) for offset, a in arrays], metas, fingerprint)


@dataclass
class WireBucket:
    """A bucket of host tensors as it crosses between processes (Ray: a trainer rank to its
    deployment): the runs of bytes that tile it in layout order (`storage_runs`: one for a packed
    bucket), its layout, and its packer's fingerprint ("" if none). Each run pickles as a numpy
    array, which pickle protocol 5 (Ray's) carries as an out-of-band buffer: written once into the
    object, read back as a view of it (read-only: consumers copy). Torch would pickle a CPU tensor's
    whole storage in-band through torch.save, for a view as for the whole, over an order of magnitude slower
    (BENCHMARKS.md, "The export fingerprints what it packs")."""

    runs: list[tuple[int, torch.Tensor]]
    metas: list[TensorMeta]
    fingerprint: str = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_wire_bucket, ([(offset, run.numpy()) for offset, run in self.runs], self.metas, self.fingerprint))

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors in their order, views of the runs (a PackedBucket when one run is
        the whole bucket and the packer's fingerprint came along)."""
        starts = [offset for offset, _ in self.runs]
        out = []
        for m in self.metas:
            if not m.nbytes:
                out.append((m.name, torch.empty(m.shape, dtype=m.dtype)))
                continue
            offset, run = self.runs[bisect.bisect_right(starts, m.offset) - 1]
            out.append((m.name, run[m.offset - offset : m.offset - offset + m.nbytes].view(m.dtype).view(m.shape)))
        if self.fingerprint and len(self.runs) == 1 and starts[0] == 0:
            return PackedBucket(out, self.runs[0][1], self.fingerprint)
        return out


def to_wire(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]] | WireBucket:
    """A bucket of host tensors as its WireBucket; one holding a tensor on a device unchanged
    (torch pickles those: they move to that device on the other side)."""
    if not bucket or any(t.device.type != "cpu" for _, t in bucket):
        return bucket
    metas, nbytes = plan_bucket(0, bucket)
    runs = storage_runs(sorted(zip(metas, [t for _, t in bucket], strict=True), key=lambda p: p[0].offset))
    return WireBucket(runs, metas, known_fingerprint(bucket, metas, nbytes) or "")


def from_wire(got: list[tuple[str, torch.Tensor]] | WireBucket, stored: Any = None) -> list[tuple[str, torch.Tensor]]:
    """The bucket `to_wire` sent. `stored`: the Ray object ref `got` was read from, when the caller
    owns it and it lies in this node's store (PackedBucket.stored)."""
    bucket = got.views() if isinstance(got, WireBucket) else got
    if isinstance(bucket, PackedBucket):
        bucket.stored = stored
    return bucket


def wire_arrays(wire: WireBucket) -> list[np.ndarray]:
    """The byte arrays tiling the bucket a WireBucket object holds, in layout order (what the
    object_store fetch checks), refusing runs that leave a gap or overlap."""
    pos = 0
    for offset, run in wire.runs:
        if offset != pos:
            raise DataLoss(f"a stored bucket's runs are not back to back: one starts at byte {offset}, not {pos}")
        pos += run.numel()
    return [run.numpy() for _, run in wire.runs]
