"""Advantage edge cases: a row with no policy token still counts its reward in its group's
baseline, a group of equal rewards gets advantage 0 (its float32 statistics gave +-0.1..0.96), and
a step whose every token the rollout correction rejected gets zero advantages, not an error."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.v1 import common_pb2
from services.common.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from services.trainer.algos import apply_rollout_correction, compute_advantages
from services.trainer.convert import groups_to_batch
from tests.unit.algo_helpers import make_batch, mask_rows


def _per_seq(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [float(row[m > 0][0]) if (m > 0).any() else 0.0 for row, m in zip(adv, mask, strict=True)]


# --- 1. A response without policy tokens loses its reward in the group baseline -------------------
# token_level_rewards puts the outcome reward on the last loss-mask-1 token; a row with none (empty
# response, or a multi-turn trajectory whose tokens are all environment tokens) gets score 0 instead
# of its reward, so the mean/std of the *other* members of its group are wrong. verl sums
# token_level_rewards without the response mask (the reward sits at the last valid position), so
# the reward always counts.


def _group_with_policyless_response(empty: bool) -> common_pb2.TrajectoryGroup:
    g = common_pb2.TrajectoryGroup(lease_id="L", prompt_token_ids=[7, 8], prompt=common_pb2.Prompt(prompt_seq=1))
    g.responses.add(sample_index=0, token_ids=[11, 12], logprobs=[-0.1, -0.2], reward=1.0)
    g.responses.add(sample_index=1, token_ids=[13, 14], logprobs=[-0.1, -0.2], reward=0.0)
    if empty:
        g.responses.add(sample_index=2, token_ids=[], logprobs=[], reward=-1.0)
    else:  # multi-turn, every token from the environment
        g.responses.add(sample_index=2, token_ids=[15, 16], logprobs=[0.0, 0.0], loss_mask=[0, 0], reward=-1.0, num_turns=1)
    return g


@pytest.mark.parametrize("empty", [True, False], ids=["empty_response", "only_env_tokens"])
def test_grpo_baseline_counts_reward_of_response_without_policy_tokens(empty: bool) -> None:
    batch = groups_to_batch([_group_with_policyless_response(empty)], pad_token_id=0)
    adv = compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo"))
    # rewards {1, 0, -1}: mean 0, unbiased std 1 -> advantages 1 and 0 for the two trainable rows
    got = _per_seq(adv, batch.response_mask)[:2]
    assert got == pytest.approx([1.0, 0.0], abs=1e-4), got  # today: [1.1547, -0.5774]


def test_rloo_baseline_counts_reward_of_response_without_policy_tokens() -> None:
    mask = mask_rows([[0, 1, 1], [0, 1, 1], [0, 0, 0]])
    batch = make_batch(mask, rewards=[1.0, 0.0, -1.0], groups=[0, 0, 0])
    adv = compute_advantages(batch, AlgorithmConfig(adv_estimator="rloo"))
    # leave-one-out: 1 - mean(0, -1) = 1.5 ; 0 - mean(1, -1) = 0
    assert _per_seq(adv, mask)[:2] == pytest.approx([1.5, 0.0], abs=1e-5)  # today: [1.0, -0.5]


# --- 2. A group of identical rewards gets O(1) same-sign GRPO advantages ---------------------------
# group_stats' float32 mean (sequential index_add_, then /n) is off by an ulp for rewards that are not
# exactly representable sums; every member then deviates by the same d, the unbiased std is
# |d| sqrt(n/(n-1)) (also ~ulp), and (s - mean) / (std + 1e-6) = +-d / (|d| sqrt(n/(n-1)) + 1e-6):
# all members of the group get the same nonzero advantage (0.106 for 16 x 0.7, -0.92 for
# 8 x 1000.1), a pure bias on a group that carries no signal (std 0 must give advantage 0).


@pytest.mark.parametrize(("value", "n"), [(0.7, 16), (0.9, 16), (1000.1, 8), (1000.1, 16)])
def test_grpo_all_equal_rewards_give_zero_advantage(value: float, n: int) -> None:
    mask = torch.ones(n, 3)
    mask[:, 0] = 0
    batch = make_batch(mask, rewards=[value] * n, groups=[5] * n)
    adv = compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo"))
    assert adv.abs().max().item() < 1e-3, adv[:, 1]


def test_a_step_whose_every_token_was_rejected_gets_zero_advantages() -> None:
    """core.py `_step_once` runs `algorithm.correct(batch)` (decoupled rejection narrows
    batch.response_mask) and then `compute_advantages(batch)`. When the rejection drops every
    token of the step (a large pi_old / pi_rollout mismatch), the engines skip the optimizer step
    ("train_step_without_response_tokens"), but compute_advantages raised first and the trainer
    loop died. verl computes (zero) advantages and goes on."""
    rc = RolloutCorrectionConfig(bypass_mode=False, rollout_rs="seq_max_k2", rollout_rs_threshold=0.01)
    algo = AlgorithmConfig(rollout_correction=rc)
    mask = mask_rows([[0, 1, 1], [0, 1, 1]])
    old = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    rollout = old - torch.tensor([[0.0, math.log(3.0), 0.0], [0.0, math.log(0.5), math.log(2.0)]])
    batch = make_batch(mask, rewards=[1, 0], groups=[0, 0], old_logprobs=old, rollout_logprobs=rollout)
    apply_rollout_correction(batch, algo)  # core.py: self.algorithm.correct(batch)
    assert batch.response_mask.sum() == 0  # every sequence rejected
    adv = compute_advantages(batch, algo)  # core.py: self.algorithm.compute_advantages(batch)
    assert torch.equal(adv, torch.zeros_like(adv))
