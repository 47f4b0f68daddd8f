"""Weights sent from every trainer rank: each rank sends the rows it owns, the receiver puts whole
tensors back together. No Ray, no gRPC.

A trainer rank that owns rows [start, stop) of a parameter with `rows` rows along dim 0 (an FSDP
shard) sends them under the wire name `shard_name(name, start, stop, rows)`; a parameter nobody
shards travels whole under its plain Hugging Face name, from one rank. Rollout engines load whole
HF tensors (vLLM's loader cuts its own tensor-parallel slices from them), so every receiver takes
every sender's shards and `ShardAssembler` rebuilds each tensor once all its rows have come, in
whatever order the senders' streams deliver them.

Checks, on top of each sender's own (fingerprints, NACK and resend, deadlines, manifest checksum):
the shards of a tensor agree on dtype, trailing shape and row count, never overlap, and cover
every row by the end (`finish`); a plain name comes once and never also as a shard. A failure is
DataLoss: the version is not loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from services.common.errors import DataLoss

from .protocols import Bucket

_SHARD = re.compile(r"^(?P<name>.+)@rows=(?P<start>\d+):(?P<stop>\d+)/(?P<rows>\d+)$")


def shard_name(name: str, start: int, stop: int, rows: int) -> str:
    """The wire name of rows [start, stop) of the `rows`-row tensor `name`."""
    if not 0 <= start < stop <= rows:
        raise ValueError(f"{name}: rows [{start}, {stop}) are not a non-empty part of [0, {rows})")
    return f"{name}@rows={start}:{stop}/{rows}"


def parse_shard(wire_name: str) -> tuple[str, int, int, int] | None:
    """(name, start, stop, rows) of a shard's wire name; None for a plain (whole-tensor) name."""
    m = _SHARD.match(wire_name)
    if m is None:
        return None
    return m["name"], int(m["start"]), int(m["stop"]), int(m["rows"])


def sender_group(group: str, rank: int) -> str:
    """The collective group that trainer rank `rank` broadcasts its shards in."""
    return f"{group}.s{rank}"


@dataclass
class _Partial:
    full: torch.Tensor
    spans: list[tuple[int, int]] = field(default_factory=list)
    filled: int = 0


class ShardAssembler:
    """Whole tensors from shards arriving in any order. `add` copies what it is given (the caller's
    buffers may be reused after it returns) and returns the tensors it completed."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self._partial: dict[str, _Partial] = {}
        self._done: set[str] = set()

    def add(self, wire_name: str, t: torch.Tensor) -> Bucket:
        parsed = parse_shard(wire_name)
        if parsed is None:
            self._claim(wire_name)
            return [(wire_name, t.to(self.device or t.device, copy=True))]
        name, start, stop, rows = parsed
        if t.dim() == 0 or t.shape[0] != stop - start:
            raise DataLoss(f"{name}: shard [{start}, {stop}) carries {tuple(t.shape)} (not {stop - start} rows)")
        part = self._partial.get(name)
        if part is None:
            if name in self._done:
                raise DataLoss(f"{name}: rows [{start}, {stop}) came after the tensor was complete (sent twice)")
            part = self._partial[name] = _Partial(torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=self.device or t.device))
        full = part.full
        if full.shape[0] != rows or full.shape[1:] != t.shape[1:] or full.dtype != t.dtype:
            raise DataLoss(f"{name}: shard [{start}, {stop}) is {t.dtype}{tuple(t.shape)} of {rows} rows, other shards "
                           f"{full.dtype}{tuple(full.shape)} (the senders disagree on the tensor)")
        if any(start < b and a < stop for a, b in part.spans):
            raise DataLoss(f"{name}: shard [{start}, {stop}) overlaps rows already received {part.spans}")
        full[start:stop].copy_(t)
        part.spans.append((start, stop))
        part.filled += stop - start
        if part.filled < rows:
            return []
        del self._partial[name]
        self._done.add(name)
        return [(name, full)]

    def _claim(self, name: str) -> None:
        if name in self._done or name in self._partial:
            raise DataLoss(f"{name}: sent whole and again (as a whole tensor or as shards)")
        self._done.add(name)

    def finish(self) -> list[str]:
        """Raise DataLoss if a tensor is still missing rows; returns the names assembled."""
        if self._partial:
            missing = {n: f"{p.filled}/{p.full.shape[0]} rows" for n, p in list(self._partial.items())[:5]}
            raise DataLoss(f"{len(self._partial)} tensors ended incomplete (every sender finished): {missing}")
        return sorted(self._done)
