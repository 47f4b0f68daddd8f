"""The engine's attention: varlen (packed rows) and Ulysses sequence parallelism, registered with
transformers as "meshrl" and steered by a per-forward context.

    packed row [1, T] = seq_0 | seq_1 | ... | tail padding      (use_remove_padding)
        flash-attn (CUDA, bf16/fp16): one flash_attn_varlen_func call over the segments
        otherwise: causal sdpa per segment (cost sum L_i^2, never a T x T mask)
    right-padded rows [B, L] with Ulysses: plain causal attention per row (exact: a real token never
        sees the padding after it)
    Ulysses (sp > 1): all-to-all q, k, v to [B, H/S, T, D] before, and the output back to
        [B, T/S, H, D] after (ulysses.py)

transformers creates no mask for an attention it does not know, so nothing of size T x T is
built; the model's own (slice-local) position ids drive RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .ulysses import all_to_all

ATTN_NAME = "meshrl"


@dataclass
class AttnContext:
    """What attention needs to know about the whole (unsliced) batch during one forward."""

    sp_group: dist.ProcessGroup | None
    sp_size: int
    bounds: list[tuple[int, int]] | None
    """[start, end) of every segment of the packed row (None: right-padded rows, causal)."""
    flash: bool = False
    """Use flash-attn kernels when the inputs are bf16/fp16 (CUDA with flash-attn installed)."""


_current: AttnContext | None = None


def activate(ctx: AttnContext) -> None:
    """Make `ctx` the context of attention calls until the next `activate`. Deliberately not
    scoped to the forward: gradient checkpointing re-runs attention during backward (possibly on
    an autograd thread), and a rank runs one micro-batch's forward and backward at a time."""
    global _current
    _current = ctx


def _expand_kv(x: torch.Tensor, size: int) -> torch.Tensor:
    """Repeat KV heads so their count is a multiple of the SP size, keeping each query head's
    group: head j becomes heads j*f .. j*f+f-1 (check_compat guarantees size % heads == 0)."""
    heads = x.shape[1]
    return x if heads % size == 0 else x.repeat_interleave(size // heads, dim=1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scaling: float | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, dropout_p=dropout, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
    )


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[tuple[int, int]] | None, dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """flash-attn on [B, H, T, D] inputs (KV heads may be fewer: GQA); returns [B, T, H, D]."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func  # type: ignore[import-not-found]

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, T, H, D]
    if bounds is None:
        return flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=scaling, causal=True)  # type: ignore[no-any-return]
    edges = [bounds[0][0]] + [e for _, e in bounds]
    cu = torch.tensor(edges, dtype=torch.int32, device=q.device)
    longest = max(e - s for s, e in bounds)
    out = flash_attn_varlen_func(
        q[0], k[0], v[0], cu, cu, longest, longest, dropout_p=dropout, softmax_scale=scaling, causal=True
    )
    return out.unsqueeze(0)  # type: ignore[no-any-return]


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: [B, H, l, D] in, [B, l, H, D] out (l = local length)."""
    ctx = _current
    assert ctx is not None, "meshrl attention called outside an engine forward (engine bug)"
    if sliding_window is not None:
        raise NotImplementedError("sliding-window attention layers are not supported with packing or Ulysses")
    q, k, v = query, key, value
    if ctx.sp_size > 1:
        assert ctx.sp_group is not None
        q = all_to_all(q, ctx.sp_group, scatter_dim=1, gather_dim=2)
        k = all_to_all(_expand_kv(k, ctx.sp_size), ctx.sp_group, scatter_dim=1, gather_dim=2)
        v = all_to_all(_expand_kv(v, ctx.sp_size), ctx.sp_group, scatter_dim=1, gather_dim=2)
    if ctx.flash and q.dtype in (torch.bfloat16, torch.float16):
        out = _flash(q, k, v, ctx.bounds, dropout, scaling)
    elif ctx.bounds is not None:
        parts = [_sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], dropout, scaling) for s, e in ctx.bounds]
        out = torch.cat(parts, dim=2).transpose(1, 2).contiguous()
    else:
        out = _sdpa(q, k, v, dropout, scaling).transpose(1, 2).contiguous()
    if ctx.sp_size > 1:
        assert ctx.sp_group is not None
        out = all_to_all(out, ctx.sp_group, scatter_dim=1, gather_dim=2)
    return out, None


def register() -> None:
    """Register `attention` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, attention)


def flash_available(device: str) -> bool:
    """flash-attn kernels can run here (CUDA and the package installed)."""
    import importlib.util

    return device == "cuda" and importlib.util.find_spec("flash_attn") is not None
