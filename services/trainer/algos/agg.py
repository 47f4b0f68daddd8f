"""Masked statistics and loss aggregation (verl `agg_loss`) under meshrl's gradient convention.

The convention (what every loss in this package returns)
---------------------------------------------------------
An optimizer step consumes one mini-batch, split over `dp_size` data-parallel ranks and, on each
rank, over micro-batches. The engine calls the loss function once per micro-batch, sums the
gradients of the returned losses over its micro-batches, and DDP/FSDP then *averages* gradients
over the ranks. So a micro-batch loss must be

    loss_mb = (the micro-batch's share of the mini-batch loss) * dp_size

where "share" uses the mini-batch's global normalizers (`LossScale.num_tokens` /
`LossScale.num_seqs`), never the micro-batch's own counts. Then

    sum over ranks r, micro-batches m of loss_{r,m} / dp_size  ==  mini-batch loss

and the averaged gradient is exactly the gradient of the mini-batch loss, however the mini-batch
was cut (tests/unit/test_algos_properties.py checks this for every aggregation mode).

Aggregation modes (`actor.loss_agg_mode`, verl names; m = response mask, l = per-token loss):
- `token-mean`:               sum_{i,t} m l / N_tokens
- `seq-mean-token-sum`:       sum_i (sum_t m l) / N_seqs
- `seq-mean-token-mean`:      sum_i (sum_t m l / sum_t m) / N_seqs
- `seq-mean-token-sum-norm`:  sum_i (sum_t m l) / N_seqs / loss_scale_factor   (Dr.GRPO)

Deviation from verl: verl's `seq-mean-token-sum-norm` divides by the padded response length when
`loss_scale_factor` is unset; meshrl batches are padded per micro-batch (prompt + response), so the
factor is required (the config fills it with `data.max_response_length`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from services.common.errors import InvalidArgument
from services.trainer.engines.base import LossScale, SequenceBatch

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is nonzero (padding garbage, even NaN, cannot leak in)."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked entries; 0 where the mask is empty."""
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return total / count.clamp(min=1)


def masked_max(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Max over masked entries; 0 where the mask is empty."""
    filled = torch.where(mask.bool(), values, torch.full_like(values, float("-inf")))
    out = filled.amax() if dim is None else filled.amax(dim=dim)
    return torch.where(torch.isneginf(out), torch.zeros_like(out), out)


def masked_min(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Min over masked entries; 0 where the mask is empty."""
    return -masked_max(-values, mask, dim)


def metrics_to_floats(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Tensor metrics to floats with one device sync (a `.item()` per metric would sync each)."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        device = torch.as_tensor(metrics[keys[0]]).device
        stacked = torch.stack([torch.as_tensor(metrics[k]).detach().float().reshape(()).to(device) for k in keys])
        out.update(zip(keys, stacked.tolist(), strict=True))
    return {k: out[k] for k in metrics}


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over masked entries (Bessel-corrected by default, as verl `masked_var`)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count <= 1:
            raise ValueError(f"masked variance needs at least 2 masked entries, got {int(count.item())}")
        var = var * count / (count - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over masked entries (verl `masked_whiten`, shift_mean=True)."""
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def loss_scale_counts(batch: SequenceBatch) -> tuple[int, int]:
    """(response tokens, sequences) of a batch: what the trainer sums over all micro-batches of all
    ranks to build a `LossScale` for one optimizer step. Every sequence counts, also one whose
    response is fully masked (rejected by rollout correction, or a prompt with no reply): verl
    divides the seq-mean modes by `ppo_mini_batch_size * rollout.n`, and meshrl's engines sum
    `SequenceBatch.num_seqs`; this helper is the same rule for callers outside an engine."""
    return int(batch.response_mask.sum().item()), batch.num_seqs


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    scale: LossScale | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a [B, L] per-token loss to a scalar (see the module docstring).

    With `scale`, the normalizers are the mini-batch's and the result is multiplied by
    `scale.dp_size` (the micro-batch convention). Without it, the normalizers are this batch's own
    and nothing is multiplied: the plain value of the loss on this batch (used for metrics and for
    single-batch callers).
    """
    mask = loss_mask.to(loss_mat.dtype)
    num_tokens: torch.Tensor | int
    num_seqs: torch.Tensor | int
    if scale is None:
        num_tokens = mask.sum().clamp(min=1)
        num_seqs = (mask.sum(dim=-1) > 0).sum().clamp(min=1)
        dp = 1
    else:
        if scale.num_tokens <= 0 or scale.num_seqs <= 0 or scale.dp_size <= 0:
            raise InvalidArgument("LossScale", f"normalizers must be positive, got {scale}")
        num_tokens, num_seqs, dp = scale.num_tokens, scale.num_seqs, scale.dp_size
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, mask) / num_tokens * dp
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq = masked_sum(loss_mat, mask, dim=-1)
        loss = seq.sum() / num_seqs * dp
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None or loss_scale_factor <= 0:
                raise InvalidArgument(
                    "actor_rollout_ref.actor.loss_scale_factor",
                    "seq-mean-token-sum-norm needs a positive constant; set it (e.g. to data.max_response_length)",
                )
            loss = loss / loss_scale_factor
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        seq = masked_sum(loss_mat, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)
        return seq.sum() / num_seqs * dp
    raise InvalidArgument("actor_rollout_ref.actor.loss_agg_mode", f"unknown mode {loss_agg_mode!r}; choose from {AGG_MODES}")
