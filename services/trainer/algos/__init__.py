"""meshrl's RL algorithms, pure torch (no Ray, no gRPC): advantages, policy losses with
off-policy corrections, KL and entropy terms, DAPO dynamic sampling. Names and defaults follow
verl's `core_algos` / `rollout_corr_helper`; deviations are documented in each module.

A trainer step, in order (the trainer owns the loop; these are the calls it makes):

    keep = dynamic_sampling_keep(dynamic_sampling_values(batch.seq_tensors, cfg.filter_groups.metric),
                                 batch.seq_tensors["group_index"])        # DAPO, if enabled
    metrics |= apply_kl_in_reward(batch, algo)    # needs old and ref logprobs; {} without use_kl_in_reward
    metrics |= apply_rollout_correction(batch, algo)                      # decoupled mode; {} in bypass
    batch.tensors["advantages"] = compute_advantages(batch, algo)         # whole step batch
    tokens, seqs = loss_scale_counts(mini_batch)  -> summed over ranks -> LossScale
    engine.train_step(micro_batches, build_loss_fn(actor, algo))

Gradient convention: see `agg.py` (sum over micro-batches and ranks of the returned losses, divided
by dp_size, is the mini-batch loss; each returned loss carries the factor dp_size).
"""

from __future__ import annotations

from .advantages import (
    KL_REWARD_KEY,
    apply_kl_in_reward,
    compute_advantages,
    discounted_returns,
    group_stats,
    token_level_rewards,
)
from .agg import AGG_MODES, agg_loss, loss_scale_counts, masked_mean, masked_sum, masked_whiten, metrics_to_floats
from .correction import (
    IS_WEIGHTS_KEY,
    RolloutCorrection,
    apply_rollout_correction,
    compute_is_weights,
    compute_rejection_mask,
    compute_rollout_correction,
    diagnose_mismatch,
)
from .dapo import dynamic_sampling_keep, dynamic_sampling_stats, dynamic_sampling_values
from .kl import kl_penalty
from .loss import build_loss_fn
from .policy_loss import gspo_loss, ppo_clip_loss, reinforce_loss

__all__ = [
    "AGG_MODES",
    "IS_WEIGHTS_KEY",
    "KL_REWARD_KEY",
    "RolloutCorrection",
    "agg_loss",
    "apply_kl_in_reward",
    "apply_rollout_correction",
    "build_loss_fn",
    "compute_advantages",
    "compute_is_weights",
    "compute_rejection_mask",
    "compute_rollout_correction",
    "diagnose_mismatch",
    "discounted_returns",
    "dynamic_sampling_keep",
    "dynamic_sampling_stats",
    "dynamic_sampling_values",
    "group_stats",
    "gspo_loss",
    "kl_penalty",
    "loss_scale_counts",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "metrics_to_floats",
    "ppo_clip_loss",
    "reinforce_loss",
    "token_level_rewards",
]
