"""The engine's attention: varlen (packed rows) and Ulysses sequence parallelism, registered with
transformers as "meshrl" and steered by a per-forward context.

    packed row [1, T] = seq_0 | seq_1 | ... | tail padding      (use_remove_padding)
        sdpa:  causal attention per segment (cost sum L_i^2, never a T x T mask)
        flash: one varlen kernel call (transformers' flash path, cu_seqlens from position_ids)
    right-padded rows [B, L] with Ulysses: plain causal attention per row (exact: a real token never
        sees the padding after it)
    Ulysses (sp > 1): all-to-all q, k, v to [B, H/S, T, D] before, and the output back to
        [B, T/S, H, D] after (ulysses.py)

transformers creates no mask for an attention it does not know, so nothing of size T x T is
built; the model's own (slice-local) position ids drive RoPE.
"""

from __future__ import annotations

from collections.abc import Callable
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
    position_ids: torch.Tensor | None
    """[1, T] position ids of the whole row (the flash kernel's varlen detection)."""
    flash: Callable[..., Any] | None
    """transformers' flash attention function, or None for the built-in sdpa paths."""


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
    if ctx.flash is not None:
        saved = getattr(module, "num_key_value_groups", None)
        if saved is not None:
            module.num_key_value_groups = q.shape[1] // k.shape[1]  # type: ignore[assignment]
        try:
            out, _ = ctx.flash(
                module, q, k, v, None, dropout=dropout, scaling=scaling, **{**kwargs, "position_ids": ctx.position_ids}
            )
        finally:
            if saved is not None:
                module.num_key_value_groups = saved  # type: ignore[assignment]
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


def flash_function(name: str) -> Callable[..., Any] | None:
    """transformers' function for a flash implementation name, None for sdpa/eager."""
    if not name.startswith("flash"):
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]  # type: ignore[no-any-return]
