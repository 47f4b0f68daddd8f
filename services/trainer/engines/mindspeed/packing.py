"""Packed (THD) sequence layout for right-padded [B, L] batches: which tokens go where, the
cumulative sequence lengths (actual and padded) and per-segment position ids. Pure torch.

MindSpeed's attention on NPU needs, for a THD batch, `set_actual_seq_len(cu_seqlens_padded)` and
`set_position_ids(position_ids[T, 1])`; megatron's PackedSeqParams needs the same cumulative
lengths. Each sequence is padded to a multiple of `align` so TP (sequence parallel) and CP
(2 * CP chunks per sequence) can split it evenly:

    align = TP * CP * 2 if CP > 1 else TP

Not wired into the engine yet, on purpose: the MindSpeed engine inherits the megatron engine's
forward step, which feeds unpacked [B, L] batches (use_remove_padding only saves compute there).
Packing needs that step to pass PackedSeqParams and call MindSpeed's set_actual_seq_len /
set_position_ids per micro-batch, and nothing NPU-side can be run where meshrl is developed; an
untested path in the engine would be worse than none. This layout is the tested piece that path
will use (tests/unit/test_mindspeed.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def thd_alignment(tp: int, cp: int) -> int:
    return tp * cp * 2 if cp > 1 else tp


@dataclass(frozen=True)
class PackedLayout:
    """Where each real token of a [B, L] batch sits in the packed [T] stream."""

    seqlens: torch.Tensor
    """[B] int32 real tokens per sequence."""
    seqlens_padded: torch.Tensor
    """[B] int32 lengths rounded up to `align`."""
    cu_seqlens: torch.Tensor
    """[B + 1] int32 cumulative real lengths, from 0."""
    cu_seqlens_padded: torch.Tensor
    """[B + 1] int32 cumulative padded lengths, from 0 (MindSpeed's actual_seq_len)."""
    position_ids: torch.Tensor
    """[T] int32 position of each packed slot inside its own (padded) segment."""
    src_index: torch.Tensor
    """[N] int64 flat index into [B * L] of every real token, in packed order."""
    dst_index: torch.Tensor
    """[N] int64 slot in [T] of every real token."""

    @property
    def total_padded(self) -> int:
        return int(self.cu_seqlens_padded[-1])


def pack_layout(attention_mask: torch.Tensor, align: int = 1) -> PackedLayout:
    """Layout of a right-padded batch (`attention_mask` [B, L], 1 for real tokens). Left padding
    or holes are rejected: the engines' contract is right padding."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    mask = attention_mask.to(torch.bool).cpu()
    b, length = mask.shape
    seqlens = mask.sum(dim=1).to(torch.int32)
    expected = torch.arange(length)[None, :] < seqlens[:, None]
    if not torch.equal(mask, expected):
        raise ValueError("attention_mask must be right-padded (1s then 0s in every row) to pack sequences")
    padded = ((seqlens + align - 1) // align * align).to(torch.int32)
    zero = torch.zeros(1, dtype=torch.int32)
    cu = torch.cat([zero, seqlens.cumsum(0).to(torch.int32)])
    cu_pad = torch.cat([zero, padded.cumsum(0).to(torch.int32)])
    total = int(cu_pad[-1])
    position_ids = torch.zeros(total, dtype=torch.int32)
    for i in range(b):
        start, end = int(cu_pad[i]), int(cu_pad[i + 1])
        position_ids[start:end] = torch.arange(end - start, dtype=torch.int32)
    rows = torch.repeat_interleave(torch.arange(b), seqlens.long())
    cols = torch.cat([torch.arange(int(n)) for n in seqlens]) if b else torch.zeros(0, dtype=torch.long)
    src = rows * length + cols
    dst = cu_pad[:-1].long()[rows] + cols
    return PackedLayout(seqlens, padded, cu, cu_pad, position_ids, src.long(), dst.long())


def pack(values: torch.Tensor, layout: PackedLayout, fill: float | int = 0) -> torch.Tensor:
    """[B, L, ...] -> [T, ...] in the packed layout (padding slots hold `fill`)."""
    flat = values.reshape(-1, *values.shape[2:])
    out = flat.new_full((layout.total_padded, *values.shape[2:]), fill)
    out[layout.dst_index.to(values.device)] = flat[layout.src_index.to(values.device)]
    return out


def unpack(packed: torch.Tensor, layout: PackedLayout, batch: int, length: int, fill: float | int = 0) -> torch.Tensor:
    """[T, ...] -> [B, L, ...], inverse of `pack` on real tokens (others hold `fill`)."""
    out = packed.new_full((batch * length, *packed.shape[1:]), fill)
    out[layout.src_index.to(packed.device)] = packed[layout.dst_index.to(packed.device)]
    return out.reshape(batch, length, *packed.shape[1:])


def mindspeed_inputs(layout: PackedLayout) -> tuple[list[int], torch.Tensor]:
    """What MindSpeed's THD attention is given: actual_seq_len (the padded cumulative lengths,
    leading 0 included, as verl passes them) and position ids shaped [T, 1]."""
    return [int(x) for x in layout.cu_seqlens_padded], layout.position_ids.view(-1, 1).contiguous()


def context_parallel_split(values: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """megatron's load-balanced CP split of a [B, L, ...] batch along `dim`: L is cut into 2*CP
    chunks and rank r keeps chunks r and 2*CP-1-r (causal attention work is then even)."""
    if cp == 1:
        return values
    n = values.shape[dim]
    if n % (2 * cp):
        raise ValueError(f"sequence length {n} must be a multiple of 2 * context_parallel_size = {2 * cp}")
    chunks = values.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=dim)


def context_parallel_merge(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `context_parallel_split` given every CP rank's part, in rank order."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * cp - 1 - r] = first, second
    return torch.cat([c for c in chunks if c is not None], dim=dim)
