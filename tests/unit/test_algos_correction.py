"""Off-policy corrections (IS weights, rejection, diagnostics, bypass/decoupled wiring) against
hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from services.common.config.actor_rollout_ref import ActorConfig
from services.common.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from services.common.errors import InvalidArgument
from services.trainer.algos import (
    IS_WEIGHTS_KEY,
    apply_rollout_correction,
    build_loss_fn,
    compute_is_weights,
    compute_rejection_mask,
    compute_rollout_correction,
    loss_scale_counts,
)
from services.trainer.engines.base import ForwardOutput, LossScale
from tests.unit.algo_helpers import make_batch, mask_rows

LN = math.log

# one sequence, three tokens with train/rollout ratios 0.4, 1.0, 3.0
TOKEN_LR = torch.tensor([[LN(0.4), 0.0, LN(3.0)]])
TOKEN_MASK = torch.ones(1, 3)
# two sequences: ratios (2.0, 1.5) and (0.8); position 2 of seq 1 is padding
SEQ_LR = torch.tensor([[LN(2.0), LN(1.5)], [LN(0.8), 0.0]])
SEQ_MASK = mask_rows([[1, 1], [1, 0]])


def test_token_tis() -> None:
    w, m = compute_is_weights(TOKEN_LR, TOKEN_MASK, "token", 2.0, "truncate")
    assert w.tolist()[0] == pytest.approx([0.4, 1.0, 2.0])
    assert m["is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m["is_ratio_fraction_low"] == pytest.approx(1 / 3)  # 0.4 < 1/2
    assert m["is_weight_mean"] == pytest.approx(3.4 / 3)
    assert m["ess"] == pytest.approx(3.4**2 / (3 * (0.16 + 1 + 4)))
    assert m["is_masked_fraction"] == 0.0


def test_token_mis_masks_above_the_threshold() -> None:
    w, m = compute_is_weights(TOKEN_LR, TOKEN_MASK, "token", 2.0, "mask")
    assert w.tolist()[0] == pytest.approx([0.4, 1.0, 0.0])
    assert m["is_masked_fraction"] == pytest.approx(1 / 3)


def test_icepop_two_sided_mask_whatever_the_mode() -> None:
    for mode in ("truncate", "mask"):
        w, m = compute_is_weights(TOKEN_LR, TOKEN_MASK, "token", "0.5_2.0", mode)
        assert w.tolist()[0] == pytest.approx([0.0, 1.0, 0.0])
        assert m["is_masked_fraction"] == pytest.approx(2 / 3)


def test_sequence_tis() -> None:
    w, m = compute_is_weights(SEQ_LR, SEQ_MASK, "sequence", 2.0, "truncate")
    # seq 0: 2.0 * 1.5 = 3 -> truncated to 2; seq 1: 0.8; padding 0
    assert w.tolist() == [pytest.approx([2.0, 2.0]), pytest.approx([0.8, 0.0])]
    assert m["ess"] == pytest.approx(2.8**2 / (2 * (4 + 0.64)))  # over sequences
    assert m["is_ratio_fraction_high"] == pytest.approx(0.5)


def test_batch_normalize() -> None:
    w, m = compute_is_weights(TOKEN_LR, TOKEN_MASK, "token", 2.0, "truncate", batch_normalize=True)
    assert w.tolist()[0] == pytest.approx([0.4 / (3.4 / 3), 1.0 / (3.4 / 3), 2.0 / (3.4 / 3)])
    assert m["is_batch_norm_factor"] == pytest.approx(3.4 / 3)
    ws, _ = compute_is_weights(SEQ_LR, SEQ_MASK, "sequence", 2.0, "truncate", batch_normalize=True)
    assert ws.tolist() == [pytest.approx([2.0 / 1.4, 2.0 / 1.4]), pytest.approx([0.8 / 1.4, 0.0])]


@pytest.mark.parametrize(
    ("option", "threshold", "keep"),
    [
        # k1 = log(rollout/train) = -lr: (log .5, log 1/1.5) for seq 0, log 1.25 for seq 1
        ("token_k1", "0.6_1.3", [[0, 1], [1, 0]]),  # keep log .6 <= k1 <= log 1.3: 1/1.5=.667 and 1.25 pass
        ("seq_mean_k1", 1.5, [[0, 0], [1, 0]]),  # seq 0 mean k1 = -log sqrt(3) < log(1/1.5)
        ("seq_sum_k1", "0.5_4", [[0, 0], [1, 0]]),  # seq 0 sum k1 = -log 3 < log .5
        ("seq_mean_k3", 0.1, [[0, 0], [1, 0]]),  # k3 = r - 1 - log r: seq 0 mean .2007, seq 1 .0231
        ("seq_max_k2", 0.2, [[0, 0], [1, 0]]),  # k2 = lr^2/2: seq 0 max .2402, seq 1 .0249
        ("seq_max_k2", 0.25, [[1, 1], [1, 0]]),
        ("token_k3", 0.1, [[0, 1], [1, 0]]),  # .3069 > .1, .0945 and .0231 pass
    ],
)
def test_rejection_options(option: str, threshold: float | str, keep: list[list[int]]) -> None:
    mask, metrics = compute_rejection_mask(SEQ_LR, SEQ_MASK, option, threshold)
    assert mask.tolist() == keep
    rejected = sum(1 for r, k in zip([[1, 1], [1, 0]], keep, strict=True) for a, b in zip(r, k, strict=True) if a and not b)
    assert metrics["rs_masked_fraction"] == pytest.approx(rejected / 3)


def test_rejection_statistics_values() -> None:
    _, m = compute_rejection_mask(SEQ_LR, SEQ_MASK, "seq_mean_k3,seq_max_k2", "1.0,1.0")
    k3 = [2.0 - 1 - LN(2.0), 1.5 - 1 - LN(1.5), 0.8 - 1 - LN(0.8)]
    assert m["rs_seq_mean_k3_mean"] == pytest.approx(((k3[0] + k3[1]) / 2 + k3[2]) / 2, abs=1e-6)
    assert m["rs_seq_max_k2_mean"] == pytest.approx((0.5 * LN(2) ** 2 + 0.5 * LN(0.8) ** 2) / 2, abs=1e-6)
    assert m["rs_masked_fraction"] == 0.0


def test_chained_rejection_needs_every_option() -> None:
    # token_k1 in [1/1.6, 1.6] rejects the token with ratio 2.0 only; seq_max_k2 <= .03 rejects seq 0
    mask, m = compute_rejection_mask(SEQ_LR, SEQ_MASK, "token_k1,seq_max_k2", "1.6,0.03")
    assert mask.tolist() == [[0, 0], [1, 0]]
    assert m["rs_token_k1_masked_fraction"] == pytest.approx(1 / 3)
    assert m["rs_seq_max_k2_masked_fraction"] == pytest.approx(2 / 3)
    assert m["rs_seq_masked_fraction"] == pytest.approx(1 / 2)


def test_mismatch_metrics() -> None:
    train = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    rollout = train - SEQ_LR
    corr = compute_rollout_correction(train, rollout, SEQ_MASK, RolloutCorrectionConfig())
    lrs = [LN(2.0), LN(1.5), LN(0.8)]
    m = corr.metrics
    assert corr.weights is None and torch.equal(corr.keep_mask, SEQ_MASK)
    assert m["rollout_corr/mismatch_kl"] == pytest.approx(-sum(lrs) / 3, abs=1e-6)
    assert m["rollout_corr/kl"] == m["rollout_corr/mismatch_kl"]
    assert m["rollout_corr/mismatch_k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in lrs) / 3, abs=1e-6)
    ratios = [2.0, 1.5, 0.8]
    assert m["rollout_corr/ess"] == pytest.approx(sum(ratios) ** 2 / (3 * sum(r * r for r in ratios)), abs=1e-6)
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(r * r for r in ratios) / 3 - 1, abs=1e-5)
    assert m["rollout_corr/chi2_seq"] == pytest.approx((9.0 + 0.64) / 2 - 1, abs=1e-5)
    # per-sequence perplexities: exp(-mean train logprob)
    assert m["rollout_corr/training_ppl"] == pytest.approx((math.exp(1.5) + math.exp(0.5)) / 2, abs=1e-5)


def test_rejected_tokens_get_zero_is_weight() -> None:
    train = torch.zeros(2, 2)
    cfg = RolloutCorrectionConfig(bypass_mode=False, rollout_is="token", rollout_rs="seq_max_k2", rollout_rs_threshold=0.2)
    corr = compute_rollout_correction(train, train - SEQ_LR, SEQ_MASK, cfg)
    assert corr.keep_mask.tolist() == [[0, 0], [1, 0]]
    assert corr.weights is not None
    assert corr.weights.tolist() == [pytest.approx([0.0, 0.0]), pytest.approx([0.8, 0.0])]


def test_config_validates_thresholds() -> None:
    with pytest.raises(ValidationError, match="rollout_is_threshold"):
        RolloutCorrectionConfig(rollout_is_threshold="2_1")
    with pytest.raises(ValidationError, match="rollout_is_threshold"):
        RolloutCorrectionConfig(rollout_is_threshold="abc")
    with pytest.raises(ValidationError, match="unknown option"):
        RolloutCorrectionConfig(rollout_rs="seq_mean_k9", rollout_rs_threshold=1.0)
    with pytest.raises(ValidationError, match="single upper bound"):
        RolloutCorrectionConfig(rollout_rs="seq_max_k2", rollout_rs_threshold="0.1_2")
    with pytest.raises(ValidationError, match="one per option"):
        RolloutCorrectionConfig(rollout_rs="seq_max_k2,token_k1", rollout_rs_threshold="1,2,3")
    with pytest.raises(ValidationError, match="bypass_mode=true"):
        RolloutCorrectionConfig(bypass_mode=False, loss_type="reinforce")
    # bypass mode's reinforce loss weighs one micro-batch at a time: a batch normalization there
    # made the gradient depend on the micro-batch size and, for sequence IS at one sequence per
    # micro-batch, turned every weight into exactly 1
    with pytest.raises(ValidationError, match="rollout_is_batch_normalize=true needs the whole batch"):
        RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="sequence", rollout_is_batch_normalize=True)
    RolloutCorrectionConfig(bypass_mode=True, loss_type="ppo_clip", rollout_is="token", rollout_is_batch_normalize=True)
    RolloutCorrectionConfig(bypass_mode=False, rollout_is="token", rollout_is_batch_normalize=True)


def decoupled_batch():
    """Two sequences (token 0 is prompt). pi_theta == pi_old (ratio 1): the PPO term is -A, so the
    loss is -A * w summed over kept tokens. Behaviour ratios pi_old/pi_rollout: (3.0, 1.0), (0.5, 2.0)."""
    mask = mask_rows([[0, 1, 1], [0, 1, 1]])
    old = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    rollout = old - torch.tensor([[0.0, LN(3.0), 0.0], [0.0, LN(0.5), LN(2.0)]])
    adv = torch.tensor([[0.0, 1.0, 1.0], [0.0, -2.0, -2.0]])
    batch = make_batch(mask, rewards=[1, 0], groups=[0, 0], advantages=adv, old_logprobs=old, rollout_logprobs=rollout)
    return batch, old.clone()


def decoupled_algo(**kw: object) -> AlgorithmConfig:
    rc = RolloutCorrectionConfig(bypass_mode=False, rollout_is="token", rollout_is_threshold=2.0, **kw)  # type: ignore[arg-type]
    return AlgorithmConfig(rollout_correction=rc)


def test_decoupled_in_loss_token_tis() -> None:
    batch, logp = decoupled_batch()
    loss, m = build_loss_fn(ActorConfig(), decoupled_algo())(ForwardOutput(logp, None), batch, LossScale(4, 2, 1))
    # weights (2.0, 1.0), (0.5, 2.0); per-token loss -A w: -2, -1, 1, 4
    assert loss.item() == pytest.approx((-2.0 - 1.0 + 1.0 + 4.0) / 4, abs=1e-6)
    assert m["rollout_corr/is_weight_mean"] == pytest.approx((2.0 + 1.0 + 0.5 + 2.0) / 4)


def test_decoupled_precomputed_rejection_leaves_the_normalizers() -> None:
    algo = decoupled_algo(rollout_rs="seq_max_k2", rollout_rs_threshold=0.4)  # k2 max: seq 0 .6035, seq 1 .2402
    batch, logp = decoupled_batch()
    metrics = apply_rollout_correction(batch, algo)
    assert batch.response_mask.tolist() == [[0, 0, 0], [0, 1, 1]]
    assert batch.tensors[IS_WEIGHTS_KEY].tolist() == [pytest.approx([0, 0, 0]), pytest.approx([0, 0.5, 2.0])]
    assert metrics["rollout_corr/rs_masked_fraction"] == pytest.approx(0.5)
    tokens, seqs = loss_scale_counts(batch)
    assert (tokens, seqs) == (2, 2)  # every sequence of the mini-batch counts (verl, the engines)
    loss, _ = build_loss_fn(ActorConfig(), algo)(ForwardOutput(logp, None), batch, LossScale(tokens, seqs, 1))
    assert loss.item() == pytest.approx((1.0 + 4.0) / 2, abs=1e-6)
    with pytest.raises(InvalidArgument, match="already applied"):
        apply_rollout_correction(batch, algo)

    # the same rejection inside the loss: same numerator, but the normalizer still counts 4 tokens
    batch2, _ = decoupled_batch()
    loss2, _ = build_loss_fn(ActorConfig(), algo)(ForwardOutput(logp, None), batch2, LossScale(4, 2, 1))
    assert loss2.item() == pytest.approx((1.0 + 4.0) / 4, abs=1e-6)


def test_decoupled_without_is_still_rejects_and_apply_is_noop_in_bypass() -> None:
    algo = AlgorithmConfig(
        rollout_correction=RolloutCorrectionConfig(bypass_mode=False, rollout_rs="token_k1", rollout_rs_threshold=2.5)
    )
    batch, _ = decoupled_batch()
    apply_rollout_correction(batch, algo)  # k1 = -log 3 < log(1/2.5): only that token goes
    assert batch.response_mask.tolist() == [[0, 0, 1], [0, 1, 1]]
    assert batch.tensors[IS_WEIGHTS_KEY].tolist() == batch.response_mask.tolist()
    bypass_batch, _ = decoupled_batch()
    assert apply_rollout_correction(bypass_batch, AlgorithmConfig()) == {}
    assert IS_WEIGHTS_KEY not in bypass_batch.tensors


def test_decoupled_batch_normalize_needs_whole_batch() -> None:
    batch, logp = decoupled_batch()
    with pytest.raises(InvalidArgument, match="apply_rollout_correction"):
        build_loss_fn(ActorConfig(), decoupled_algo(rollout_is_batch_normalize=True))(
            ForwardOutput(logp, None), batch, LossScale(4, 2, 1)
        )


def test_bypass_reinforce_uses_current_policy_weights() -> None:
    mask = mask_rows([[0, 1, 1]])
    rollout = torch.tensor([[0.0, -1.0, -1.0]])
    logp = torch.tensor([[0.0, -1.0 + LN(3.0), -1.0 + LN(0.5)]], requires_grad=True)
    adv = torch.tensor([[0.0, 1.0, 1.0]])
    batch = make_batch(mask, rewards=[1], groups=[0], advantages=adv, old_logprobs=rollout.clone())
    rc = RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0)
    loss, m = build_loss_fn(ActorConfig(), AlgorithmConfig(rollout_correction=rc))(
        ForwardOutput(logp, None), batch, LossScale(2, 1, 1)
    )
    # w = min(pi_theta/pi_rollout, 2) = (2, 0.5); loss = mean(-A w log pi)
    lp = logp.detach()[0]
    assert loss.item() == pytest.approx((-2.0 * lp[1].item() - 0.5 * lp[2].item()) / 2, abs=1e-6)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1.0, -0.25])
    assert m["rollout_corr/is_ratio_fraction_high"] == pytest.approx(0.5)


def test_bypass_ppo_clip_only_logs_is_weights_but_rejects() -> None:
    mask = mask_rows([[0, 1, 1], [0, 1, 1]])
    rollout = torch.full((2, 3), -1.0)
    logp = rollout + torch.tensor([[0.0, LN(1.1), 0.0], [0.0, LN(4.0), 0.0]])
    adv = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    batch = make_batch(mask, rewards=[1, 0], groups=[0, 0], advantages=adv, old_logprobs=rollout.clone())
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_rs="seq_max_k2", rollout_rs_threshold=0.5)
    loss, m = build_loss_fn(ActorConfig(), AlgorithmConfig(rollout_correction=rc))(
        ForwardOutput(logp, None), batch, LossScale(4, 2, 1)
    )
    # seq 1 has k2 = (log 4)^2/2 = .96 > .5: rejected. seq 0: PPO -1.1 and -1.0, no IS weight applied
    assert loss.item() == pytest.approx((-1.1 - 1.0) / 4, abs=1e-6)
    assert m["rollout_corr/is_weight_max"] == pytest.approx(2.0)  # logged, truncated at 2
