"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.config.algorithm import AlgorithmConfig, KLControlConfig
from services.common.errors import InvalidArgument
from services.trainer.algos import (
    KL_REWARD_KEY,
    apply_kl_in_reward,
    compute_advantages,
    discounted_returns,
    token_level_rewards,
)
from tests.unit.algo_helpers import make_batch, mask_rows

SQRT3 = math.sqrt(1.0 / 3.0)  # unbiased std of {1,0,0,1} and of {1,1,0}


def seven_seqs():
    """Group 7: rewards 1,0,0,1; group 3: rewards 1,1,0. Responses of various lengths."""
    mask = mask_rows(
        [
            [0, 1, 1, 0],
            [0, 1, 0, 0],
            [0, 1, 1, 1],
            [0, 0, 1, 1],
            [0, 1, 1, 1],
            [0, 1, 0, 0],
            [0, 1, 1, 0],
        ]
    )
    return make_batch(mask, rewards=[1, 0, 0, 1, 1, 1, 0], groups=[7, 7, 7, 7, 3, 3, 3])


def per_seq(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The (constant) advantage of each sequence; asserts it is constant on the response, 0 elsewhere."""
    out = []
    for row, m in zip(adv, mask, strict=True):
        on = row[m > 0]
        assert torch.allclose(on, on[0].expand_as(on))
        assert torch.all(row[m == 0] == 0)
        out.append(float(on[0]))
    return out


def test_grpo_with_std() -> None:
    batch = seven_seqs()
    adv = compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo"))
    a, b = 0.5 / (SQRT3 + 1e-6), (1 / 3) / (SQRT3 + 1e-6)
    expected = [a, -a, -a, a, b, b, -2 * b]
    assert per_seq(adv, batch.response_mask) == pytest.approx(expected, abs=1e-6)
    assert expected[0] == pytest.approx(0.866025, abs=1e-5) and expected[6] == pytest.approx(-1.154700, abs=1e-5)


def test_grpo_without_std_and_drgrpo() -> None:
    batch = seven_seqs()
    expected = [0.5, -0.5, -0.5, 0.5, 1 / 3, 1 / 3, -2 / 3]
    a1 = compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=False))
    a2 = compute_advantages(batch, AlgorithmConfig(adv_estimator="drgrpo"))  # never divides, whatever the flag
    assert per_seq(a1, batch.response_mask) == pytest.approx(expected, abs=1e-6)
    assert torch.equal(a1, a2)


def test_rloo_leave_one_out() -> None:
    batch = seven_seqs()
    adv = compute_advantages(batch, AlgorithmConfig(adv_estimator="rloo"))
    # group 7: 1 - mean(0,0,1) = 2/3; 0 - mean(1,0,1) = -2/3; group 3: 1 - mean(1,0) = 0.5; 0 - 1 = -1
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.5, 0.5, -1.0]
    assert per_seq(adv, batch.response_mask) == pytest.approx(expected, abs=1e-6)


def test_singleton_group_keeps_raw_score_like_verl() -> None:
    batch = make_batch(mask_rows([[0, 1, 1], [0, 1, 0], [0, 1, 1]]), rewards=[0.7, 1.0, 0.0], groups=[5, 9, 9])
    grpo = per_seq(compute_advantages(batch, AlgorithmConfig()), batch.response_mask)
    rloo = per_seq(compute_advantages(batch, AlgorithmConfig(adv_estimator="rloo")), batch.response_mask)
    assert grpo[0] == pytest.approx(0.7 / (1 + 1e-6), abs=1e-7)
    assert rloo[0] == pytest.approx(0.7)
    # group 9, two members: mean .5, unbiased std sqrt(.5)
    assert grpo[1:] == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)], abs=1e-6)
    assert rloo[1:] == pytest.approx([1.0, -1.0])


def test_reinforce_plus_plus_gamma_one_whitens_over_tokens() -> None:
    # seq 0: two response tokens, reward 1; seq 1: one response token, reward 0
    batch = make_batch(mask_rows([[0, 1, 1], [0, 1, 0]]), rewards=[1.0, 0.0], groups=[0, 0])
    adv = compute_advantages(batch, AlgorithmConfig(adv_estimator="reinforce_plus_plus"))
    # token returns [1, 1, 0]: mean 2/3, unbiased var 1/3
    s = math.sqrt(1 / 3 + 1e-8)
    expected = torch.tensor([[0, (1 / 3) / s, (1 / 3) / s], [0, (-2 / 3) / s, 0]])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_reinforce_plus_plus_discount() -> None:
    batch = make_batch(mask_rows([[0, 1, 1], [0, 1, 0]]), rewards=[1.0, 0.0], groups=[0, 0])
    adv = compute_advantages(batch, AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=0.5))
    # returns: seq 0 [0.5, 1], seq 1 [0]; mean .5, unbiased var .25 -> whitened [0, 1], [-1]
    expected = torch.tensor([[0, 0.0, 1.0], [0, -1.0, 0]])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_discounted_returns_carry_across_masked_gaps() -> None:
    # multi-turn: response, masked tool output, response. Reward on the last response token.
    mask = mask_rows([[0, 1, 1, 0, 1]])
    rewards = token_level_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 1.0]]
    assert discounted_returns(rewards, mask, 0.5).tolist() == [[0, 0.25, 0.5, 0, 1.0]]
    assert discounted_returns(rewards, mask, 1.0).tolist() == [[0, 1.0, 1.0, 0, 1.0]]


def test_reinforce_plus_plus_baseline() -> None:
    batch = make_batch(mask_rows([[0, 1, 1], [0, 1, 0]]), rewards=[1.0, 0.0], groups=[4, 4])
    adv = compute_advantages(batch, AlgorithmConfig(adv_estimator="reinforce_plus_plus_baseline"))
    # minus group mean: [.5, -.5]; tiled tokens [.5, .5, -.5]: mean 1/6, unbiased var 1/3
    s = math.sqrt(1 / 3 + 1e-8)
    expected = torch.tensor([[0, (1 / 3) / s, (1 / 3) / s], [0, (-2 / 3) / s, 0]])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_kl_in_reward_fixed_controller() -> None:
    mask = mask_rows([[0, 1, 1], [0, 1, 0]])
    old = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, 0.0]])
    ref = torch.tensor([[0.0, -2.0, -2.0], [0.0, -2.0, 0.0]])  # k1 = old - ref = 1 per response token
    batch = make_batch(mask, rewards=[1.0, 1.0], groups=[0, 0], old_logprobs=old, ref_logprobs=ref)
    cfg = AlgorithmConfig(adv_estimator="drgrpo", use_kl_in_reward=True, kl_penalty="kl", kl_ctrl=KLControlConfig(kl_coef=0.1))
    # scores: 1 - 0.1*2 = 0.8 and 1 - 0.1*1 = 0.9; group mean 0.85
    assert per_seq(compute_advantages(batch, cfg), mask) == pytest.approx([-0.05, 0.05], abs=1e-6)
    with pytest.raises(InvalidArgument, match=r"kl_ctrl\.type"):
        compute_advantages(batch, cfg.model_copy(update={"kl_ctrl": KLControlConfig(type="adaptive")}))
    with pytest.raises(ValueError, match=r"kl_ctrl\.type=adaptive is not implemented"):
        AlgorithmConfig(use_kl_in_reward=True, kl_ctrl=KLControlConfig(type="adaptive"))
    AlgorithmConfig(use_kl_in_reward=False, kl_ctrl=KLControlConfig(type="adaptive"))  # unused: accepted


def test_kl_in_reward_applied_before_the_correction_covers_the_whole_response() -> None:
    """The trainer applies the penalty before the rollout correction rejects tokens (verl's
    apply_kl_penalty then compute_rollout_correction then compute_advantage): a token rejected
    afterwards still costs its KL in the sequence's score."""
    mask = mask_rows([[0, 1, 1], [0, 1, 0]])
    old = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, 0.0]])
    ref = torch.tensor([[0.0, -2.0, -2.0], [0.0, -2.0, 0.0]])
    batch = make_batch(mask, rewards=[1.0, 1.0], groups=[0, 0], old_logprobs=old, ref_logprobs=ref)
    cfg = AlgorithmConfig(adv_estimator="drgrpo", use_kl_in_reward=True, kl_penalty="kl", kl_ctrl=KLControlConfig(kl_coef=0.1))
    metrics = apply_kl_in_reward(batch, cfg)
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(1.0), "actor/reward_kl_penalty_coeff": pytest.approx(0.1)}
    assert torch.allclose(batch.tensors[KL_REWARD_KEY], 0.1 * mask)
    batch.response_mask = mask_rows([[0, 1, 0], [0, 1, 0]])  # the correction rejects row 0's last token
    adv = compute_advantages(batch, cfg)
    assert per_seq(adv, batch.response_mask) == pytest.approx([-0.05, 0.05], abs=1e-6)
    with pytest.raises(InvalidArgument, match="already applied"):
        apply_kl_in_reward(batch, cfg)
    assert apply_kl_in_reward(batch, AlgorithmConfig()) == {}


def test_bad_inputs_name_the_field() -> None:
    mask = mask_rows([[0, 1], [0, 1]])
    with pytest.raises(InvalidArgument, match="'reward'"):
        compute_advantages(make_batch(mask, groups=[0, 0]), AlgorithmConfig())
    with pytest.raises(InvalidArgument, match="'group_index'"):
        compute_advantages(make_batch(mask, rewards=[1, 0]), AlgorithmConfig())
    with pytest.raises(InvalidArgument, match="non-finite"):
        compute_advantages(make_batch(mask, rewards=[float("nan"), 0], groups=[0, 0]), AlgorithmConfig())
    bad = make_batch(mask, rewards=[1, 0], groups=[0, 0])
    bad.seq_tensors["group_index"] = torch.tensor([0.0, 0.0])
    with pytest.raises(InvalidArgument, match="integer"):
        compute_advantages(bad, AlgorithmConfig())
