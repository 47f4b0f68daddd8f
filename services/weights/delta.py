"""Delta sync (`param_server.delta_sync`): a version travels as the elements that changed since
the version every receiver already holds. In bf16 an optimizer step moves few weights by a whole
unit in the last place (verl reports 1-3% of the bytes per step), so most of a version is the
previous one again.

    sender (trainer rank; a copy of what it last sent)      receivers (a copy of what they hold)
    rendezvous: every receiver holds base b == mine? ──▶ delta, else whole tensors
    per tensor: idx = where new != base (bitwise)    ──▶ mirror[idx] = val
                val = new[idx], base[idx] = val               columns(mirror) == sum ? else DataLoss
                sum = fingerprint columns of new              (the version fails; the next is whole)

It rides on a collective transport (nccl / hccl / gloo), where every receiver takes part in every
version: the base is agreed at the param server's rendezvous (each receiver reports the version
its copy holds, the sender learns whether all hold the one it last sent), and anything else (a
new or restarted receiver, a version that failed anywhere) sends whole tensors, which refill
every copy. The encoded tensors are ordinary bucket entries, so the transport's fingerprints,
NACK/resend and deadlines cover them as they cover whole tensors; the rebuilt tensor is checked
against the sender's fingerprint of it, so a receiver's copy that drifted from the sender's
cannot load silently: the version fails there, and the next one goes whole.

Wire entries of a version (tensor names are Hugging Face names, which never contain '#'):
    "#delta.base"            int64 [base version (0: whole tensors), version]; first bucket
    "<name>"                 a whole tensor
    "<name>#delta.idx"       int32 (int64 past 2^31 elements) flat indices of changed elements
    "<name>#delta.val"       the new values there, the tensor's dtype
    "<name>#delta.sum"       int64 [K] fingerprint columns of the whole new tensor

A tensor goes whole when it is small (< MIN_DELTA_BYTES: the columns alone are 4 KiB), not a
floating-point tensor, new or reshaped, or when its delta would not be smaller. Both copies cost
one model's worth of memory on the device of the sender and of each receiver.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.errors import DataLoss

from .layout import FINGERPRINT_COLUMNS, tensor_columns, tensor_nbytes
from .protocols import Bucket, Buckets, iterate_buckets

if TYPE_CHECKING:
    import torch

BASE = "#delta.base"
IDX, VAL, SUM = "#delta.idx", "#delta.val", "#delta.sum"
PARTS = (IDX, VAL, SUM)
MIN_DELTA_BYTES = 64 * 1024


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` flat, read as integers of its element size (a bitwise comparison: -0.0 != 0.0, NaN == NaN)."""
    import torch

    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.reshape(-1).view(kinds[t.element_size()])


def _eligible(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.element_size() in (2, 4, 8) and tensor_nbytes(t) >= MIN_DELTA_BYTES


def split_part(name: str) -> tuple[str, str] | None:
    """("<name>", "#delta.idx") for a delta entry's wire name, else None."""
    for part in PARTS:
        if name.endswith(part):
            return name[: -len(part)], part
    return None


@dataclass
class DeltaStats:
    """One version, as sent or received."""

    version: int = 0
    base_version: int = 0
    whole_bytes: int = 0
    """What the version's tensors weigh whole."""
    sent_bytes: int = 0
    """What travelled: whole tensors plus the delta entries."""
    delta_tensors: int = 0
    changed_elements: int = 0
    delta_elements: int = 0
    """Elements of the tensors sent as deltas (changed_elements / delta_elements: the changed share)."""

    def as_dict(self) -> dict[str, float]:
        return {
            "version": self.version, "base_version": self.base_version, "whole_bytes": self.whole_bytes,
            "sent_bytes": self.sent_bytes, "sent_fraction": self.sent_bytes / self.whole_bytes if self.whole_bytes else 1.0,
            "delta_tensors": self.delta_tensors, "changed_elements": self.changed_elements,
            "changed_fraction": self.changed_elements / self.delta_elements if self.delta_elements else 0.0,
        }


class DeltaEncoder:
    """The sender's side: keeps a copy of what it last sent (per wire name, on the tensors'
    device) and turns a version's buckets into delta entries against it. `version` is the version
    the copy holds once `commit` confirmed every receiver got it (0: none; the next is whole)."""

    def __init__(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self.base: dict[str, torch.Tensor] = {}
        self.version = 0
        self.last = DeltaStats()
        self.device = device
        """Where the copy lives and deltas are computed (the transport's device): an export on the
        host is moved there first (the broadcast would copy it there anyway)."""
        self.dtype = dtype
        """Floating-point tensors travel in this dtype (the rollout's, e.g. bf16): its bits are the
        ones that change rarely, and the rollout would cast to it on load anyway. None: as exported."""

    def reset(self) -> None:
        """The version in progress failed: the copy may be half updated, so the next goes whole
        (the memory is kept and refilled)."""
        self.version = 0

    def commit(self, version: int) -> None:
        self.version = version

    async def encode(self, version: int, buckets: Buckets, agreed_base: Callable[[], Awaitable[int]]) -> AsyncIterator[Bucket]:
        """`buckets` as wire buckets; `agreed_base()`: the version every receiver holds (0: not one
        version), asked before the first bucket is encoded."""
        import torch

        base = await agreed_base()
        held, self.version = self.version, 0  # in transition until commit()
        delta = base != 0 and base == held
        stats = self.last = DeltaStats(version=version, base_version=base if delta else 0)
        first = True
        async for bucket in iterate_buckets(buckets):
            out: Bucket = []
            if first and bucket:
                device = bucket[0][1].device
                out.append((BASE, torch.tensor([stats.base_version, version], dtype=torch.int64, device=device)))
                first = False
            out.extend(self._bucket(bucket, delta, stats))
            yield out
        if first:  # nothing to send (a sharded sender that owns nothing): the receivers still learn the base
            yield [(BASE, torch.tensor([stats.base_version, version], dtype=torch.int64, device=self.device or "cpu"))]

    def _bucket(self, bucket: Bucket, delta: bool, stats: DeltaStats) -> Bucket:
        """One bucket's entries, in order. Each tensor's `nonzero` reads its count back to the
        host: counting the whole bucket first to read the counts at once costs more than the
        syncs it saves (BENCHMARKS.md, "Delta sync")."""
        import torch

        out: Bucket = []
        for name, t in bucket:
            if self.device is not None and t.device != torch.device(self.device):
                t = t.to(self.device, non_blocking=t.is_pinned())  # cast on the device, not on the host's CPUs
            if t.is_floating_point() and self.dtype is not None and t.dtype != self.dtype:
                t = t.to(dtype=self.dtype)
            nbytes = tensor_nbytes(t)
            stats.whole_bytes += nbytes
            if _eligible(t):
                base = self.base.get(name)
                if base is None or base.shape != t.shape or base.dtype != t.dtype or base.device != t.device:
                    base = self.base[name] = torch.empty_like(t, memory_format=torch.contiguous_format)
                elif delta:
                    changed = (_bits(t) != _bits(base)).nonzero().squeeze(1)
                    count = changed.numel()
                    idx_dtype = torch.int32 if t.numel() < 2**31 else torch.int64
                    delta_bytes = count * (idx_dtype.itemsize + t.element_size()) + FINGERPRINT_COLUMNS * 8
                    if delta_bytes < nbytes:
                        values = t.reshape(-1)[changed]
                        base.view(-1)[changed] = values
                        stats.sent_bytes += delta_bytes
                        stats.delta_tensors += 1
                        stats.changed_elements += count
                        stats.delta_elements += t.numel()
                        out += [(name + IDX, changed.to(idx_dtype)), (name + VAL, values), (name + SUM, tensor_columns(base))]
                        continue
                base.copy_(t)
            stats.sent_bytes += nbytes
            out.append((name, t))
        return out


class DeltaDecoder:
    """A receiver's side: keeps a copy of the version it holds (per wire name, on its device) and
    rebuilds whole tensors from a version's entries. Yields the copy's tensors for delta entries
    (valid until the next version) and the received ones for whole entries."""

    def __init__(self) -> None:
        self.mirror: dict[str, torch.Tensor] = {}
        self._held = 0
        self._in_progress = 0
        self._base: int | None = None
        self._parts: dict[str, dict[str, torch.Tensor]] = {}
        self.last = DeltaStats()
        """The last version received whole or rebuilt (what the rollout's status reports): a
        version in progress shows here only once commit() checked it, never half counted."""
        self._stats = DeltaStats()  # the version in progress

    @property
    def version(self) -> int:
        """The version the copy holds whole (0: none; what this receiver reports at the rendezvous)."""
        return self._held

    def begin(self, version: int) -> None:
        """A version starts. One begun before and neither committed nor reset left the copy half
        updated: the copy then holds nothing."""
        if self._in_progress:
            self._held = 0
        self._in_progress = version
        self._base = None
        self._parts = {}
        self._stats = DeltaStats(version=version)

    def reset(self) -> None:
        """The version in progress failed or was broken off: the next one goes whole."""
        self._held = self._in_progress = 0
        self._parts = {}

    def commit(self) -> None:
        """Every bucket of the version was decoded, and the transport checked them all."""
        version, self._in_progress = self._in_progress, 0
        if self._base is None:
            self._held = 0
            raise DataLoss(f"version {version}: no {BASE!r} entry (the sender does not use delta sync; set "
                           "param_server.delta_sync the same on the trainer and the rollouts)")
        if self._parts:
            self._held = 0
            raise DataLoss(f"version {version}: delta entries without all their parts ({sorted(self._parts)[:4]}); "
                           "the peers disagree on the protocol")
        self._held = version
        self.last = self._stats

    def decode(self, bucket: Bucket) -> Bucket:
        import torch

        out: Bucket = []
        checks: list[tuple[str, torch.Tensor]] = []
        stats = self._stats
        for name, t in bucket:
            if name == BASE:
                base, version = (int(x) for x in t.tolist())
                if version != self._in_progress or (base and base != self._held):
                    raise DataLoss(f"version {self._in_progress}: the sender sends a delta against version {base} "
                                   f"for version {version}; this receiver holds version {self._held} (the next "
                                   "version goes whole)")
                self._base = stats.base_version = base
                # Delta entries that came first wait whole in _parts: the bucket carrying this
                # entry was resent after a NACK and arrived after later buckets.
                for target in [n for n, p in self._parts.items() if len(p) == len(PARTS)]:
                    rebuilt, same = self._apply(target, self._parts.pop(target))
                    out.append((target, rebuilt))
                    checks.append((target, same))
                continue
            part = split_part(name)
            if part is None:
                stats.whole_bytes += tensor_nbytes(t)
                stats.sent_bytes += tensor_nbytes(t)
                if _eligible(t):
                    held = self.mirror.get(name)
                    if held is None or held.shape != t.shape or held.dtype != t.dtype or held.device != t.device:
                        held = self.mirror[name] = torch.empty_like(t, memory_format=torch.contiguous_format)
                    held.copy_(t)
                out.append((name, t))
                continue
            target, kind = part
            parts = self._parts.setdefault(target, {})
            parts[kind] = t
            stats.sent_bytes += tensor_nbytes(t)
            if len(parts) == len(PARTS) and self._base is not None:
                del self._parts[target]
                held, same = self._apply(target, parts)
                out.append((target, held))
                checks.append((target, same))
        for name, t in bucket:  # parts still waiting for the rest: the slot is reused after this bucket
            part = split_part(name)
            if part is not None and part[0] in self._parts:
                self._parts[part[0]][part[1]] = t.clone()
        if checks:  # one host sync per bucket, before any rebuilt tensor reaches the consumer
            for (name, _), ok in zip(checks, torch.stack([same for _, same in checks]).tolist(), strict=True):
                if not ok:
                    raise DataLoss(f"version {self._in_progress}: {name!r} rebuilt from version {self._held} does not "
                                   "match the sender's fingerprint (this receiver's copy drifted; the next version "
                                   "goes whole)")
        return out

    def _apply(self, name: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rebuilt tensor (the copy, updated in place) and whether it matches the sender's
        fingerprint (a device bool: read once per bucket)."""
        if not self._base:
            raise DataLoss(f"version {self._in_progress}: a delta entry for {name!r} before the version's "
                           f"{BASE!r} entry said it is a delta (the peers disagree on the protocol)")
        held = self.mirror.get(name)
        idx, values = parts[IDX], parts[VAL]
        if held is None or values.dtype != held.dtype or values.device != held.device:
            raise DataLoss(f"version {self._in_progress}: a delta for {name!r}, which this receiver's copy of "
                           f"version {self._held} does not hold as {values.dtype} (the next version goes whole)")
        held.view(-1)[idx] = values
        same = (tensor_columns(held) == parts[SUM].to(held.device)).all()
        stats = self._stats
        stats.whole_bytes += tensor_nbytes(held)
        stats.delta_tensors += 1
        stats.changed_elements += idx.numel()
        stats.delta_elements += held.numel()
        return held, same


def fetch_stats(fetcher: object) -> dict[str, float]:
    """Delta sync's numbers for the last version `fetcher` received (summed over a sharded
    fetcher's parts; empty without delta sync): what the rollout's status reports."""
    parts = getattr(fetcher, "parts", None) or [fetcher]
    last = [d.last for d in (getattr(p, "delta", None) for p in parts) if isinstance(d, DeltaDecoder)]
    if not last:
        return {}
    whole, sent = sum(x.whole_bytes for x in last), sum(x.sent_bytes for x in last)
    changed = sum(x.changed_elements for x in last)
    return {"weights/delta_version": float(min(x.version for x in last)),
            "weights/delta_base_version": float(min(x.base_version for x in last)),
            "weights/whole_bytes": float(whole), "weights/sent_bytes": float(sent),
            "weights/sent_fraction": sent / whole if whole else 1.0,
            "weights/delta_tensors": float(sum(x.delta_tensors for x in last)),
            "weights/changed_fraction": changed / elements if (elements := sum(x.delta_elements for x in last)) else 0.0}
