"""Weights sent from every trainer rank: each rank sends the part it owns, the receiver puts whole
tensors back together. No Ray, no gRPC.

A trainer rank that owns rows [start, stop) of a parameter with `size` rows along dim 0 (an FSDP
shard, a megatron column-parallel slice) sends them under the wire name
`shard_name(name, start, stop, size)`, `name@rows=start:stop/size`; columns along dim 1 (a
megatron row-parallel slice: o_proj, down_proj) go as `name@cols=start:stop/size`. A tensor
nobody shards travels whole under its plain Hugging Face name, from one rank. Rollout engines load
whole HF tensors (vLLM's loader cuts its own tensor-parallel slices from them), so every receiver
takes every sender's shards and `ShardAssembler` rebuilds each tensor once all its rows (or
columns) have come, in whatever order the senders' streams deliver them.

Checks, on top of each sender's own (fingerprints, NACK and resend, deadlines, manifest checksum):
the shards of a tensor agree on dtype, split dim, the other dims' sizes and the split dim's size,
never overlap, and cover it by the end (`finish`); a plain name comes once and never also as a
shard. A failure is DataLoss: the version is not loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from services.common.errors import DataLoss

from .protocols import Bucket

_SHARD = re.compile(r"^(?P<name>.+)@(?P<axis>rows|cols)=(?P<start>\d+):(?P<stop>\d+)/(?P<size>\d+)$")
_AXES = ("rows", "cols")


class Shard(NamedTuple):
    """A parsed shard wire name: [start, stop) of the `size` entries of `name` along `dim`."""

    name: str
    start: int
    stop: int
    size: int
    dim: int = 0


def shard_name(name: str, start: int, stop: int, size: int, dim: int = 0) -> str:
    """The wire name of [start, stop) of the `size` rows (dim 0) or columns (dim 1) of `name`."""
    if dim not in (0, 1):
        raise ValueError(f"{name}: shards split dim 0 (rows) or 1 (columns), not {dim}")
    if not 0 <= start < stop <= size:
        raise ValueError(f"{name}: [{start}, {stop}) is not a non-empty part of [0, {size})")
    return f"{name}@{_AXES[dim]}={start}:{stop}/{size}"


def parse_shard(wire_name: str) -> Shard | None:
    """The shard a wire name stands for; None for a plain (whole-tensor) name."""
    m = _SHARD.match(wire_name)
    if m is None:
        return None
    return Shard(m["name"], int(m["start"]), int(m["stop"]), int(m["size"]), _AXES.index(m["axis"]))


def sender_group(group: str, rank: int) -> str:
    """The collective group that trainer rank `rank` broadcasts its shards in."""
    return f"{group}.s{rank}"


@dataclass
class _Partial:
    full: torch.Tensor
    dim: int
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
        name, start, stop, size, dim = parsed
        axis = _AXES[dim]
        if t.dim() <= dim or t.shape[dim] != stop - start:
            raise DataLoss(f"{name}: shard [{start}, {stop}) carries {tuple(t.shape)} (not {stop - start} {axis})")
        part = self._partial.get(name)
        if part is None:
            if name in self._done:
                raise DataLoss(f"{name}: {axis} [{start}, {stop}) came after the tensor was complete (sent twice)")
            shape = list(t.shape)
            shape[dim] = size
            part = self._partial[name] = _Partial(torch.empty(shape, dtype=t.dtype, device=self.device or t.device), dim)
        full = part.full
        want = list(full.shape)
        want[dim] = stop - start
        if part.dim != dim or full.shape[dim] != size or list(t.shape) != want or full.dtype != t.dtype:
            raise DataLoss(f"{name}: {axis} [{start}, {stop}) of {size} come as {t.dtype}{tuple(t.shape)}, other shards "
                           f"split dim {part.dim} of {full.dtype}{tuple(full.shape)} (the senders disagree on the tensor)")
        if any(start < b and a < stop for a, b in part.spans):
            raise DataLoss(f"{name}: {axis} [{start}, {stop}) overlap {axis} already received {part.spans}")
        full.narrow(dim, start, stop - start).copy_(t)
        part.spans.append((start, stop))
        part.filled += stop - start
        if part.filled < size:
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
            missing = {n: f"{p.filled}/{p.full.shape[p.dim]} {_AXES[p.dim]}" for n, p in list(self._partial.items())[:5]}
            raise DataLoss(f"{len(self._partial)} tensors ended incomplete (every sender finished): {missing}")
        return sorted(self._done)
