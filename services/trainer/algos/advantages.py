"""Outcome-reward advantage estimators (verl `core_algos`), vectorized over groups.

Every estimator takes per-sequence scores (the sum of a sequence's token-level rewards; with an
outcome reward that is just the reward) and the group index (sequences sampled from one prompt
share it), and returns [B, L] advantages that are 0 outside `response_mask`.

- `grpo`: (s - mean_g) / (std_g + 1e-6), std unbiased (torch.std); without std when
  `algorithm.norm_adv_by_std_in_grpo=false`.
- `drgrpo`: Dr.GRPO (arXiv 2503.20783): s - mean_g, never divided by the std. verl spells this
  `grpo` + `norm_adv_by_std_in_grpo=false`; the paper pairs it with
  `actor.loss_agg_mode=seq-mean-token-sum-norm`, which is left to the config.
- `rloo`: s_i - mean of the other n-1 scores of the group = n/(n-1) (s_i - mean_g).
- `reinforce_plus_plus`: discounted return-to-go of token rewards (gamma), whitened over all
  response tokens of the batch. No group baseline.
- `reinforce_plus_plus_baseline`: s - mean_g, broadcast to the response tokens, whitened over all
  response tokens of the batch.

A group with a single sequence gets mean 0 and std 1, so its advantage is its raw score (verl's
`grpo`, `rloo` and `reinforce_plus_plus_baseline` do the same; verl's `rloo_vectorized` gives 0).
The config refuses group estimators with `rollout.n < 2`, so this only happens if a trainer hands
over a partial group.

The REINFORCE++ estimators whiten over the whole batch, so call `compute_advantages` on the whole
step batch, before it is split over ranks or micro-batches.

Deviation from verl: verl's REINFORCE++ return recursion restarts at every masked position, so in a
multi-turn sequence (tool output masked between turns) earlier turns get no return. Here the
discount counts response tokens only and carries across masked gaps; for a contiguous response
(single turn) the two are identical.
"""

from __future__ import annotations

import torch

from services.common.config.algorithm import AlgorithmConfig
from services.common.errors import InvalidArgument
from services.trainer.engines.base import SequenceBatch

from .agg import masked_mean, masked_whiten
from .kl import kl_penalty

EPSILON = 1e-6
KL_REWARD_KEY = "kl_in_reward"
"""batch.tensors key of the per-token KL penalty `apply_kl_in_reward` takes off the rewards."""
ESTIMATORS: tuple[str, ...] = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def group_stats(scores: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (group mean, unbiased group std, group size), broadcast back to [B].
    Singleton groups get mean 0 and std 1 (verl). Computed in float64: in float32 the mean of
    equal rewards that float32 cannot hold exactly (0.7) is an ulp off, the std as small, and
    (score - mean) / (std + eps) a same-sign advantage near +-1 for a group with no signal."""
    out_dtype, scores = scores.dtype, scores.double()
    _, inv = torch.unique(group_index, return_inverse=True)
    num_groups = int(inv.max().item()) + 1 if inv.numel() else 0
    count = torch.bincount(inv, minlength=num_groups).to(scores.dtype)
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inv, scores)
    mean = sums / count
    dev2 = torch.zeros_like(sums).index_add_(0, inv, (scores - mean[inv]) ** 2)
    multi = count > 1
    std = torch.where(multi, torch.sqrt(dev2 / (count - 1).clamp(min=1)), torch.ones_like(sums))
    mean = torch.where(multi, mean, torch.zeros_like(mean))
    return mean[inv].to(out_dtype), std[inv].to(out_dtype), count[inv].to(out_dtype)


def grpo_advantage(
    scores: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor, norm_by_std: bool = True
) -> torch.Tensor:
    """GRPO (and, with `norm_by_std=False`, Dr.GRPO) outcome advantages, [B, L]."""
    mean, std, _ = group_stats(scores, group_index)
    adv = (scores - mean) / (std + EPSILON) if norm_by_std else scores - mean
    return adv.unsqueeze(-1) * response_mask


def rloo_advantage(scores: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """RLOO (arXiv 2402.14740): each score minus the mean of the others in its group, [B, L]."""
    _, _, count = group_stats(scores, group_index)
    _, inv = torch.unique(group_index, return_inverse=True)
    sums = torch.zeros(int(inv.max().item()) + 1, dtype=scores.dtype, device=scores.device).index_add_(0, inv, scores)
    loo = (count * scores - sums[inv]) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, loo, scores)
    return adv.unsqueeze(-1) * response_mask


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go over response tokens: G_t = sum_{s >= t, s response} gamma^(k(s) - k(t)) r_s,
    where k counts response tokens. 0 outside the mask."""
    mask = response_mask.to(token_rewards.dtype)
    rewards = token_rewards * mask
    if gamma == 1.0:
        return torch.flip(torch.cumsum(torch.flip(rewards, dims=[-1]), dim=-1), dims=[-1]) * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        on = mask[:, t] > 0
        running = torch.where(on, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(on, running, torch.zeros_like(running))
    return returns


def reinforce_plus_plus_advantage(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262): whitened discounted returns, [B, L]."""
    returns = discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask) * response_mask


def reinforce_plus_plus_baseline_advantage(
    scores: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++-baseline: group-mean baseline, then batch whitening over response tokens, [B, L]."""
    mean, _, _ = group_stats(scores, group_index)
    tiled = (scores - mean).unsqueeze(-1) * response_mask
    return masked_whiten(tiled, response_mask) * response_mask


def token_level_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome reward placed on each sequence's last response token, [B, L]."""
    mask = response_mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards[rows]
    return out


def _seq_tensor(batch: SequenceBatch, key: str) -> torch.Tensor:
    if key not in batch.seq_tensors:
        raise InvalidArgument(f"batch.seq_tensors[{key!r}]", f"missing (present: {sorted(batch.seq_tensors)})")
    value = batch.seq_tensors[key]
    if value.shape != (batch.num_seqs,):
        raise InvalidArgument(f"batch.seq_tensors[{key!r}]", f"shape {tuple(value.shape)} != ({batch.num_seqs},)")
    return value


def kl_reward_penalty(batch: SequenceBatch, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, L] kl_ctrl.kl_coef * kl_penalty(old_logprobs, ref_logprobs, cfg.kl_penalty) on the
    response tokens (verl's `apply_kl_penalty`, fixed controller) and its metrics:
    `actor/reward_kl_penalty` (the batch mean of each sequence's mean KL) and
    `actor/reward_kl_penalty_coeff`."""
    for key in ("old_logprobs", "ref_logprobs"):
        if key not in batch.tensors:
            raise InvalidArgument(f"batch.tensors[{key!r}]", "required by algorithm.use_kl_in_reward=true")
    if cfg.kl_ctrl.type != "fixed":
        raise InvalidArgument(
            "algorithm.kl_ctrl.type", "only the fixed KL-in-reward controller is implemented; set algorithm.kl_ctrl.type=fixed"
        )
    mask = batch.response_mask.to(torch.float32)
    kld = kl_penalty(batch.tensors["old_logprobs"].float(), batch.tensors["ref_logprobs"].float(), cfg.kl_penalty) * mask
    beta = float(cfg.kl_ctrl.kl_coef)
    per_seq = masked_mean(kld, mask, dim=-1)
    metrics = {"actor/reward_kl_penalty": float(per_seq.mean()) if per_seq.numel() else 0.0, "actor/reward_kl_penalty_coeff": beta}
    return beta * kld, metrics


def apply_kl_in_reward(batch: SequenceBatch, cfg: AlgorithmConfig) -> dict[str, float]:
    """Writes `kl_reward_penalty` into batch.tensors[KL_REWARD_KEY], which `compute_advantages`
    takes off the rewards, and returns its metrics ({} without `use_kl_in_reward`). The trainer
    calls it once the old and reference logprobs are in and before the rollout correction narrows
    the response mask (verl's order: the penalty covers the whole response)."""
    if not cfg.use_kl_in_reward:
        return {}
    if KL_REWARD_KEY in batch.tensors:
        raise InvalidArgument(f"batch.tensors[{KL_REWARD_KEY!r}]", "the KL penalty was already applied to this batch")
    batch.tensors[KL_REWARD_KEY], metrics = kl_reward_penalty(batch, cfg)
    return metrics


def compute_advantages(batch: SequenceBatch, cfg: AlgorithmConfig) -> torch.Tensor:
    """[B, L] float32 token-level advantages (0 outside response_mask) for `cfg.adv_estimator`.

    Reads batch.seq_tensors["reward"] (float [B]) and batch.seq_tensors["group_index"] (int [B]).
    With `cfg.use_kl_in_reward`, each response token's reward is reduced by the penalty
    `apply_kl_in_reward` wrote (where it has not, by `kl_reward_penalty` of the batch as it is,
    which needs the old and reference logprobs in batch.tensors).
    Call it on the whole step batch (groups must be complete; REINFORCE++ whitens over the batch).
    """
    rewards = _seq_tensor(batch, "reward").to(torch.float32)
    group_index = _seq_tensor(batch, "group_index")
    if group_index.is_floating_point() or group_index.dtype == torch.bool:
        raise InvalidArgument("batch.seq_tensors['group_index']", f"must be an integer tensor, got {group_index.dtype}")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise InvalidArgument("batch.seq_tensors['reward']", f"non-finite rewards at rows {bad[:8]}")
    mask = batch.response_mask.to(torch.float32)
    if mask.sum() == 0:
        # every token rejected by the decoupled rollout correction (or no policy token at all):
        # nothing to learn from; the engine skips the optimizer step (train_step_without_response_tokens)
        return torch.zeros_like(mask)

    token_rewards = token_level_rewards(rewards, mask)
    # the outcome reward counts in its group's baseline even for a row with no policy token to
    # carry it (an empty response, a trajectory of environment tokens only)
    scores = rewards
    if cfg.use_kl_in_reward:
        if KL_REWARD_KEY in batch.tensors:
            penalty = batch.tensors[KL_REWARD_KEY].to(torch.float32)
        else:
            penalty, _ = kl_reward_penalty(batch, cfg)
        token_rewards = token_rewards - penalty
        scores = rewards - penalty.sum(dim=-1)

    est = cfg.adv_estimator
    with torch.no_grad():
        if est == "grpo":
            return grpo_advantage(scores, group_index, mask, norm_by_std=cfg.norm_adv_by_std_in_grpo)
        if est == "drgrpo":
            return grpo_advantage(scores, group_index, mask, norm_by_std=False)
        if est == "rloo":
            return rloo_advantage(scores, group_index, mask)
        if est == "reinforce_plus_plus":
            return reinforce_plus_plus_advantage(token_rewards, mask, cfg.gamma)
        if est == "reinforce_plus_plus_baseline":
            return reinforce_plus_plus_baseline_advantage(scores, group_index, mask)
    raise InvalidArgument("algorithm.adv_estimator", f"unknown estimator {est!r}; choose from {ESTIMATORS}")
