"""Per-token policy-gradient losses (verl `core_algos.compute_policy_loss_*`), unaggregated.

Each function returns the [B, L] per-token loss matrix (aggregation is `agg.agg_loss`'s job, so
one set of normalizers serves every term) and metrics (verl names, micro-batch values) as detached
0-dim tensors, so the loss never syncs the device (`agg.metrics_to_floats` converts them once).
`is_weights`, when given, are detached behaviour-correction weights that multiply the loss matrix
(decoupled PPO; verl's `rollout_is_weights`).

- `ppo_clip_loss` (verl `vanilla`): r = exp(clamp(log pi - log pi_old, -20, 20));
  l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); for A < 0 also l = min(l, -A c) (dual clip,
  arXiv 1912.09729, c = `clip_ratio_c` > 1). eps_high > eps_low is DAPO's clip-higher.
- `gspo_loss` (arXiv 2507.18071): sequence ratio s = exp(mean_t (log pi - log pi_old)); each token
  carries s with the gradient of its own log pi: log s_t = sg(log s) + log pi - sg(log pi), clamped
  to <= 10; l = max(-A s_t, -A clip(s_t, 1 - eps_low, 1 + eps_high)); no dual clip. Aggregated
  with `actor.loss_agg_mode` like every other term, as verl 0.9.1 does (its GSPO loss passes
  `loss_agg_mode` to `agg_loss`; verl 0.8/0.9.0 forced `seq-mean-token-mean`). The paper's
  sequence-level objective is `loss_agg_mode=seq-mean-token-mean`; verl's default is token-mean.
- `reinforce_loss` (verl `compute_policy_loss_reinforce`, bypass mode): l = -A w log pi, w the
  detached IS weight (1 when IS is off).
"""

from __future__ import annotations

import torch

from .agg import masked_mean, masked_sum

Metrics = dict[str, torch.Tensor | float]

LOG_RATIO_BOUND = 20.0


def _apply_weights(loss: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    return loss if is_weights is None else loss * is_weights.detach()


def ppo_clip_loss(
    old_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate with dual clip; metrics actor/pg_clipfrac, actor/pg_clipfrac_lower,
    actor/ppo_kl (mean of log pi_old - log pi)."""
    assert clip_ratio_c > 1.0, f"clip_ratio_c must exceed 1 (dual clip), got {clip_ratio_c}"
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(clipped, loss3)
    negative = advantages < 0
    loss = torch.where(negative, dual, clipped)
    fmask = mask.to(loss.dtype)
    metrics: Metrics = {
        "actor/pg_clipfrac": masked_mean((loss2 > loss1).to(loss.dtype), fmask),
        "actor/pg_clipfrac_lower": masked_mean(((clipped > loss3) & negative).to(loss.dtype), fmask),
        "actor/ppo_kl": masked_mean(-log_ratio.detach(), fmask),
    }
    return _apply_weights(loss, is_weights), metrics


def gspo_loss(
    old_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO with the sequence-level ratio; same metric names as `ppo_clip_loss`
    (pg_clipfrac_lower is 0: GSPO has no dual clip)."""
    fmask = mask.to(logprobs.dtype)
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, torch.zeros_like(logprobs))
    seq_log_ratio = masked_sum(log_ratio, fmask, dim=-1) / fmask.sum(dim=-1).clamp(min=1)
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(loss1, loss2)
    metrics: Metrics = {
        "actor/pg_clipfrac": masked_mean((loss2 > loss1).to(loss.dtype), fmask),
        "actor/pg_clipfrac_lower": 0.0,
        "actor/ppo_kl": masked_mean(-log_ratio.detach(), fmask),
    }
    return _apply_weights(loss, is_weights), metrics


def reinforce_loss(
    rollout_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """-A w log pi; metric actor/ppo_kl = mean of log pi_rollout - log pi."""
    fmask = mask.to(logprobs.dtype)
    loss = _apply_weights(-advantages * logprobs, is_weights)
    kl = torch.where(mask.bool(), rollout_logprobs - logprobs.detach(), torch.zeros_like(logprobs))
    return loss, {"actor/ppo_kl": masked_mean(kl, fmask)}
