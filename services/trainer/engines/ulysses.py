"""Ulysses sequence parallelism: every rank of an SP group of size S holds 1/S of each sequence;
attention trades that for 1/S of the heads over the whole sequence with two all-to-alls.

    rank r: tokens [r*L/S, (r+1)*L/S) ── q,k,v proj ──▶ [B, H, L/S, D]
            all-to-all (scatter heads, gather sequence) ──▶ [B, H/S, L, D]
            attention over the whole sequence, H/S heads
            all-to-all (scatter sequence, gather heads) ──▶ [B, L/S, H, D] ── o_proj

Everything outside attention is per-token, so the rest of the model runs unchanged on the slice.
The engine installs `attention` under the name "meshrl_ulysses" (transformers' attention
interface) and sets, around each forward, a context with the SP group and the full-sequence mask
information (a model only sees its own slice, so the mask it builds is not usable).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ATTN_NAME = "meshrl_ulysses"


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


@dataclass
class UlyssesContext:
    """What attention needs about the whole sequence during one forward."""

    group: dist.ProcessGroup
    size: int
    inner: Callable[..., Any]
    """The attention implementation run on the gathered sequence (sdpa, flash ...)."""
    inner_is_flash: bool
    segment_ids: torch.Tensor | None
    """[T] packed-sequence ids over the whole row (None: right-padded rows, plain causal)."""
    position_ids: torch.Tensor | None
    """[1, T] full position ids (flash varlen detection)."""
    _mask: torch.Tensor | None = None

    def mask(self, device: torch.device) -> torch.Tensor | None:
        """Block-diagonal causal mask [1, 1, T, T] for packed rows (None: causal only)."""
        if self.segment_ids is None:
            return None
        if self._mask is None:
            seg = self.segment_ids.to(device)
            n = seg.shape[0]
            causal = torch.ones((n, n), dtype=torch.bool, device=device).tril()
            self._mask = (causal & (seg[:, None] == seg[None, :]))[None, None]
        return self._mask


_local = threading.local()


@contextlib.contextmanager
def active(ctx: UlyssesContext) -> Iterator[None]:
    """Make `ctx` the context of attention calls in this thread."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = prev


def _expand_kv(x: torch.Tensor, size: int) -> torch.Tensor:
    """Repeat KV heads so that their count is a multiple of the SP size while keeping each query
    head's group: head j becomes heads j*f .. j*f+f-1."""
    heads = x.shape[1]
    if heads % size == 0:
        return x
    factor = size // heads
    return x.repeat_interleave(factor, dim=1)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function ([B, H, L/S, D] in, [B, L/S, H, D] out)."""
    ctx: UlyssesContext | None = getattr(_local, "ctx", None)
    assert ctx is not None, "Ulysses attention called outside an SP forward (engine bug)"
    q = all_to_all(query, ctx.group, scatter_dim=1, gather_dim=2)
    k = all_to_all(_expand_kv(key, ctx.size), ctx.group, scatter_dim=1, gather_dim=2)
    v = all_to_all(_expand_kv(value, ctx.size), ctx.group, scatter_dim=1, gather_dim=2)
    groups = q.shape[1] // k.shape[1]
    saved = getattr(module, "num_key_value_groups", None)
    if saved is not None:
        module.num_key_value_groups = groups  # type: ignore[assignment]  # the inner kernel repeats KV by this factor
    try:
        if ctx.inner_is_flash:
            kwargs = {**kwargs, "position_ids": ctx.position_ids}
            out, _ = ctx.inner(module, q, k, v, None, **kwargs)
        else:
            out, _ = ctx.inner(module, q, k, v, ctx.mask(q.device), is_causal=ctx.segment_ids is None, **kwargs)
    finally:
        if saved is not None:
            module.num_key_value_groups = saved  # type: ignore[assignment]
    # out: [B, L, H/S, D] -> [B, L/S, H, D]
    return all_to_all(out, ctx.group, scatter_dim=1, gather_dim=2), None


def register() -> None:
    """Register `attention` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, attention)


def inner_attention(name: str) -> Callable[..., Any]:
    """The transformers attention function registered as `name`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        name = "sdpa"  # eager is per-model; sdpa computes the same thing
    return ALL_ATTENTION_FUNCTIONS[name]  # type: ignore[no-any-return]
