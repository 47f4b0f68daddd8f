"""Off-policy corrections between the behaviour (rollout) policy and the trained policy
(verl `rollout_corr_helper`): importance weights, rejection by mismatch, mismatch diagnostics.

Three policies may be involved: pi_rollout (behaviour, logprobs from the inference engine),
pi_old (proximal: the parameters at the start of the sync window, recomputed by the trainer in
decoupled mode) and pi_theta (current). "train" below is whichever policy the correction compares
with pi_rollout:

- bypass mode (`algorithm.rollout_correction.bypass_mode=true`): old = rollout logprobs, so the PPO
  ratio pi_theta / pi_rollout already absorbs off-policyness. IS weights and rejection compare the
  current (detached) pi_theta with pi_rollout, inside the loss, per micro-batch (verl
  `compute_policy_loss_bypass_mode`). With `loss_type=ppo_clip` the IS weights are only logged
  (applying them would count the ratio twice); with `loss_type=reinforce` they multiply -A log pi.
- decoupled mode (`bypass_mode=false`): PPO clips pi_theta / pi_old, and the behaviour correction
  w = pi_old / pi_rollout multiplies the clipped term (AReaL's decoupled PPO). The weights and the
  rejection mask are constants of the batch: call `apply_rollout_correction` once on the whole
  step batch before splitting it and counting `LossScale`, so that rejected tokens also leave the
  normalizers (verl `compute_rollout_correction_and_add_to_batch`). If the trainer skips it, the
  loss computes the same weights per micro-batch, and rejected tokens contribute zero but still
  count in the normalizers (and `rollout_is_batch_normalize` is refused there, since it needs the
  whole batch).

IS weights (`rollout_is`): token: w_t = exp(lr_t); sequence: w = exp(sum_t lr_t), broadcast, with
lr = log pi_train - log pi_rollout clamped to [-20, 20] (verl SAFETY_BOUND).
- float threshold u, `rollout_is_mode=truncate`: w = min(w, u)                     (TIS)
- float threshold u, `rollout_is_mode=mask`:     w = w if w <= u else 0            (MIS)
- "lo_hi" threshold:                             w = w if lo <= w <= hi else 0     (IcePop; verl
  always masks for a "lo_hi" string, whatever the mode)
Masked weights zero the token's policy-gradient term; the token still counts in the normalizers.

Rejection (`rollout_rs`, verl semantics): token statistics k1 = -lr (= log pi_rollout/pi_train),
k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr; `token_*` judge each token, `seq_sum_*`, `seq_mean_*`,
`seq_max_*` judge a whole sequence by the sum/mean/max of its tokens' statistic. `*_k1` keep
log(lo) <= stat <= log(hi); others keep stat <= upper. Chained options must all pass.

Metrics (all under `rollout_corr/`): `mismatch_kl` (k1 estimate of KL(pi_rollout || pi_train),
verl's `kl`), `mismatch_k3_kl` (verl `k3_kl`), `ess` (normalized effective sample size
(sum w)^2 / (n sum w^2) in (0, 1] of the applied weights, over tokens or sequences by level; of the
raw token ratios when no IS is configured), `is_weight_mean/max/min`, `is_ratio_fraction_high/low`,
`is_masked_fraction`, `rs_masked_fraction`, `rs_seq_masked_fraction`, `rs_<option>_mean`,
`rs_<option>_masked_fraction`, plus `training_ppl`, `rollout_ppl`, `log_ppl_diff`, `chi2_token`,
`chi2_seq`, and verl aliases `kl`, `k3_kl`, `rollout_is_mean`, `rollout_is_eff_sample_size`,
`rollout_rs_masked_fraction`. Deviation: verl's ESS for sequence-level IS is computed over the
broadcast token weights; here it is over sequences (one weight each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.common.config.algorithm import (
    AlgorithmConfig,
    RolloutCorrectionConfig,
    parse_is_threshold,
    parse_rs_options,
    parse_rs_thresholds,
)
from services.common.errors import InvalidArgument
from services.trainer.engines.base import SequenceBatch

from .agg import masked_max, masked_mean, masked_min, masked_sum, metrics_to_floats

SAFETY_BOUND = 20.0
IS_WEIGHTS_KEY = "rollout_is_weights"
"""batch.tensors key written by `apply_rollout_correction`; its presence means 'already applied'."""


Metrics = dict[str, torch.Tensor]
"""0-dim detached tensors; `agg.metrics_to_floats` converts them with one device sync."""


@dataclass
class RolloutCorrection:
    """Result of `compute_rollout_correction` for one batch."""

    weights: torch.Tensor | None
    """[B, L] detached IS weights, 0 outside the kept mask; None when `rollout_is` is null."""
    keep_mask: torch.Tensor
    """[B, L] response mask with rejected tokens zeroed (same dtype as the input mask)."""
    metrics: Metrics
    """`rollout_corr/...` scalars as 0-dim tensors (see `agg.metrics_to_floats`)."""


def ess_fraction(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(sum w)^2 / (n sum w^2) over the masked weights: 1 for uniform weights, 0 if all are zero,
    1 if the mask is empty."""
    m = mask.to(weights.dtype)
    n = m.sum()
    total = (weights * m).sum()
    total_sq = (weights * weights * m).sum()
    ess = total * total / (n * total_sq).clamp(min=torch.finfo(weights.dtype).tiny)
    return torch.where(n == 0, torch.ones_like(ess), torch.where(total_sq > 0, ess, torch.zeros_like(ess)))


def _seq_valid(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(dim=-1) > 0).to(torch.float32)


def compute_is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold: float | str,
    mode: str = "truncate",
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, Metrics]:
    """[B, L] detached IS weights pi_train / pi_rollout (see the module docstring) and metrics
    (without the `rollout_corr/` prefix). Statistics are over tokens (token level) or over
    sequences with a response token (sequence level)."""
    upper, lower = parse_is_threshold(threshold)
    fmask = mask.to(torch.float32)
    lr = torch.where(mask.bool(), log_ratio.detach().float(), torch.zeros_like(fmask))
    if level == "token":
        raw = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        seq_lr = lr.sum(dim=-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        raw = torch.exp(seq_lr).expand_as(lr)
    else:
        raise InvalidArgument("algorithm.rollout_correction.rollout_is", f"must be token, sequence or null, got {level!r}")
    raw = raw * fmask
    masks = lower is not None or mode == "mask"
    if lower is not None:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    elif mode == "mask":
        weights = torch.where(raw <= upper, raw, torch.zeros_like(raw))
    elif mode == "truncate":
        weights = raw.clamp(max=upper)
    else:
        raise InvalidArgument("algorithm.rollout_correction.rollout_is_mode", f"must be truncate or mask, got {mode!r}")

    if level == "token":
        w_units, raw_units, unit_mask = weights, raw, fmask
    else:
        # a sequence weight is broadcast along its row (0 on padding): the row max is its value
        w_units, raw_units, unit_mask = weights.amax(dim=-1), raw.amax(dim=-1), _seq_valid(mask)
    lo = lower if lower is not None else 1.0 / upper
    metrics: Metrics = {
        "is_weight_mean": masked_mean(w_units, unit_mask),
        "is_weight_max": masked_max(w_units, unit_mask),
        "is_weight_min": masked_min(w_units, unit_mask),
        "is_ratio_fraction_high": masked_mean((raw_units > upper).float(), unit_mask),
        "is_ratio_fraction_low": masked_mean((raw_units < lo).float(), unit_mask),
        "is_masked_fraction": masked_mean((w_units == 0).float(), unit_mask) if masks else w_units.new_zeros(()),
        "ess": ess_fraction(w_units, unit_mask),
    }
    if batch_normalize:
        norm = masked_mean(w_units, unit_mask)
        norm = torch.where(norm > 1e-8, norm, torch.ones_like(norm))
        weights = weights / norm
        metrics["is_batch_norm_factor"] = norm
    return weights.detach(), metrics


def compute_rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, rollout_rs: str, threshold: float | str
) -> tuple[torch.Tensor, Metrics]:
    """[B, L] keep mask (1 kept, 0 rejected or outside `mask`, dtype of `mask`) and metrics (no prefix)."""
    options = parse_rs_options(rollout_rs)
    bounds = parse_rs_thresholds(options, threshold)
    fmask = mask.to(torch.float32)
    lr = torch.where(mask.bool(), log_ratio.detach().float(), torch.zeros_like(fmask)).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": torch.exp(lr) - 1.0 - lr}
    valid = _seq_valid(mask)
    keep = torch.ones_like(fmask, dtype=torch.bool)
    metrics: Metrics = {}
    for opt in options:
        lower, upper = bounds[opt]
        scope, kind = opt.rsplit("_", 1)
        tok = stats[kind]
        if scope == "token":
            stat = tok
            metrics[f"rs_{opt}_mean"] = masked_mean(tok, fmask)
        else:
            if scope == "seq_sum":
                seq = masked_sum(tok, fmask, dim=-1)
            elif scope == "seq_mean":
                seq = masked_mean(tok, fmask, dim=-1)
            else:
                seq = masked_max(tok, fmask, dim=-1)
            stat = seq.unsqueeze(-1).expand_as(tok)
            metrics[f"rs_{opt}_mean"] = masked_mean(seq, valid)
        if kind == "k1":
            assert lower is not None
            ok = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            ok = stat <= upper
        keep &= ok
        metrics[f"rs_{opt}_masked_fraction"] = masked_mean((~ok).float(), fmask)
    keep_mask = (keep & mask.bool()).to(mask.dtype)
    rejected = (mask.bool() & ~keep).float()
    metrics["rs_masked_fraction"] = masked_mean(rejected, fmask)
    metrics["rs_seq_masked_fraction"] = masked_mean(rejected.amax(dim=-1), valid)
    return keep_mask, metrics


def mismatch_metrics(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """Diagnostics of pi_train against pi_rollout on the sampled tokens (no prefix; verl
    `compute_offpolicy_metrics`)."""
    fmask = mask.to(torch.float32)
    train = torch.where(mask.bool(), train_logprobs.detach().float(), torch.zeros_like(fmask))
    rollout = torch.where(mask.bool(), rollout_logprobs.detach().float(), torch.zeros_like(fmask))
    lr = train - rollout
    lr_safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    valid = _seq_valid(mask)
    seq_train = masked_mean(train, fmask, dim=-1)
    seq_rollout = masked_mean(rollout, fmask, dim=-1)
    seq_lr = masked_sum(lr, fmask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratios = torch.exp(lr_safe)
    return {
        "mismatch_kl": masked_mean(-lr, fmask),
        "mismatch_k3_kl": masked_mean(ratios - lr_safe - 1.0, fmask),
        "training_ppl": masked_mean(torch.exp(-seq_train), valid),
        "rollout_ppl": masked_mean(torch.exp(-seq_rollout), valid),
        "log_ppl_diff": masked_mean(seq_rollout - seq_train, valid),
        "chi2_token": masked_mean(ratios * ratios, fmask) - 1.0,
        "chi2_seq": masked_mean(torch.exp(2.0 * seq_lr), valid) - 1.0,
        "ess": ess_fraction(ratios, fmask),
    }


def compute_rollout_correction(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> RolloutCorrection:
    """IS weights, rejection mask and metrics of pi_train against pi_rollout for one batch.
    Everything is detached; `train_logprobs` may carry gradients. No device sync."""
    if train_logprobs.shape != rollout_logprobs.shape or train_logprobs.shape != response_mask.shape:
        raise InvalidArgument(
            "rollout correction",
            f"shapes differ: train {tuple(train_logprobs.shape)}, rollout {tuple(rollout_logprobs.shape)}, "
            f"mask {tuple(response_mask.shape)}",
        )
    train = train_logprobs.detach().float()
    rollout = rollout_logprobs.detach().float()
    log_ratio = train - rollout
    metrics = mismatch_metrics(train, rollout, response_mask)
    keep_mask = response_mask
    if cfg.rollout_rs is not None:
        assert cfg.rollout_rs_threshold is not None, "config validation guarantees a threshold"
        keep_mask, rs_metrics = compute_rejection_mask(log_ratio, response_mask, cfg.rollout_rs, cfg.rollout_rs_threshold)
        metrics.update(rs_metrics)
    weights = None
    if cfg.rollout_is is not None:
        weights, is_metrics = compute_is_weights(
            log_ratio, response_mask, cfg.rollout_is, cfg.rollout_is_threshold, cfg.rollout_is_mode, cfg.rollout_is_batch_normalize
        )
        metrics.update(is_metrics)  # `ess` of the applied weights replaces that of the raw ratios
        weights = weights * keep_mask.to(weights.dtype)
    return RolloutCorrection(weights=weights, keep_mask=keep_mask, metrics=_prefixed(metrics))


def _prefixed(metrics: Metrics) -> Metrics:
    out = {f"rollout_corr/{k}": v for k, v in metrics.items()}
    for alias, key in (
        ("kl", "mismatch_kl"),
        ("k3_kl", "mismatch_k3_kl"),
        ("rollout_is_mean", "is_weight_mean"),
        ("rollout_is_eff_sample_size", "ess"),
        ("rollout_rs_masked_fraction", "rs_masked_fraction"),
    ):
        if key in metrics:
            out[f"rollout_corr/{alias}"] = metrics[key]
    return out


def diagnose_mismatch(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """`rollout_corr/*` mismatch diagnostics only (no weights, no rejection)."""
    return _prefixed(mismatch_metrics(train_logprobs, rollout_logprobs, mask))


def apply_rollout_correction(batch: SequenceBatch, algo: AlgorithmConfig) -> dict[str, float]:
    """Decoupled mode: compute the behaviour correction pi_old / pi_rollout on the whole step batch
    and write it into the batch, before it is split and `LossScale` is counted. In place: sets
    batch.tensors["rollout_is_weights"] (1 where IS is off) and zeroes rejected tokens of
    batch.response_mask. Returns `rollout_corr/*` metrics. Bypass mode: nothing to do (the
    correction there is against the current policy, inside the loss); returns {}.

    Call at most once per batch: the weights' presence tells the loss the batch is corrected.
    """
    rc = algo.rollout_correction
    if rc.bypass_mode:
        return {}
    if IS_WEIGHTS_KEY in batch.tensors:
        raise InvalidArgument(f"batch.tensors[{IS_WEIGHTS_KEY!r}]", "rollout correction was already applied to this batch")
    for key in ("old_logprobs", "rollout_logprobs"):
        if key not in batch.tensors:
            raise InvalidArgument(f"batch.tensors[{key!r}]", "required by decoupled mode (rollout_correction.bypass_mode=false)")
    corr = compute_rollout_correction(batch.tensors["old_logprobs"], batch.tensors["rollout_logprobs"], batch.response_mask, rc)
    keep = corr.keep_mask.to(batch.response_mask.dtype)
    weights = corr.weights if corr.weights is not None else keep.to(torch.float32)
    batch.tensors[IS_WEIGHTS_KEY] = weights
    batch.response_mask = keep
    return metrics_to_floats(corr.metrics)
