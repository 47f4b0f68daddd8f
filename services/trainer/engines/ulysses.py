"""Ulysses sequence parallelism, the communication part: every rank of an SP group of size S
holds 1/S of each sequence; attention trades that for 1/S of the heads over the whole sequence
with two all-to-alls (see attention.py for where they run).

    rank r: tokens [r*L/S, (r+1)*L/S) ── q,k,v proj ──▶ [B, H, L/S, D]
            all-to-all (scatter heads, gather sequence) ──▶ [B, H/S, L, D]
            attention over the whole sequence, H/S heads
            all-to-all (scatter sequence, gather heads) ──▶ [B, L/S, H, D] ── o_proj

Everything outside attention is per-token, so the rest of the model runs unchanged on the slice;
per-token results are gathered back with `gather_seq`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    inputs = [t.contiguous() for t in torch.tensor_split(x, size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: split `scatter_dim` across ranks, concatenate `gather_dim`."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)  # type: ignore[no-any-return]


class _GatherSeq(torch.autograd.Function):
    """All-gather along `dim`. Every SP rank computes the same loss from the gathered tensor, so
    the gradient of this rank's slice is its slice of the incoming gradient (no reduction)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        size = dist.get_world_size(group)
        ctx.group, ctx.dim, ctx.rank, ctx.size = group, dim, dist.get_rank(group), size
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return torch.tensor_split(grad, ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None


def gather_seq(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Differentiable gather of sequence slices (see _GatherSeq for the gradient convention)."""
    return _GatherSeq.apply(x, group, dim)  # type: ignore[no-any-return]


def slice_seq(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This rank's slice of a sequence dimension whose length is a multiple of `size`."""
    assert x.shape[dim] % size == 0, f"sequence length {x.shape[dim]} is not a multiple of the SP size {size}"
    return torch.tensor_split(x, size, dim=dim)[rank]
