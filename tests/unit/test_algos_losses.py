"""Aggregation, policy losses, KL estimators and the composed loss, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.config.actor_rollout_ref import ActorConfig, PolicyLossConfig
from services.common.config.algorithm import AlgorithmConfig
from services.common.errors import InvalidArgument
from services.trainer.algos import agg_loss, build_loss_fn, gspo_loss, kl_penalty, ppo_clip_loss, reinforce_loss
from services.trainer.engines.base import ForwardOutput, LossScale
from tests.unit.algo_helpers import logs, make_batch, mask_rows

LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0]])
LOSS_MASK = mask_rows([[1, 1, 1, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "local", "scaled"),
    [
        # local: own normalizers; scaled: LossScale(num_tokens=10, num_seqs=4, dp_size=3)
        ("token-mean", 15 / 5, 15 / 10 * 3),
        ("seq-mean-token-sum", (6 + 9) / 2, (6 + 9) / 4 * 3),
        ("seq-mean-token-mean", (2 + 4.5) / 2, (2 + 4.5) / 4 * 3),
        ("seq-mean-token-sum-norm", (6 + 9) / 2 / 4, (6 + 9) / 4 * 3 / 4),
    ],
)
def test_agg_modes(mode: str, local: float, scaled: float) -> None:
    assert agg_loss(LOSS_MAT, LOSS_MASK, mode, None, loss_scale_factor=4).item() == pytest.approx(local)
    scale = LossScale(num_tokens=10, num_seqs=4, dp_size=3)
    assert agg_loss(LOSS_MAT, LOSS_MASK, mode, scale, loss_scale_factor=4).item() == pytest.approx(scaled)


def test_agg_ignores_padding_garbage_and_rejects_bad_input() -> None:
    garbage = LOSS_MAT.clone()
    garbage[0, 3] = float("nan")
    assert agg_loss(garbage, LOSS_MASK, "token-mean").item() == pytest.approx(3.0)
    with pytest.raises(InvalidArgument, match="loss_scale_factor"):
        agg_loss(LOSS_MAT, LOSS_MASK, "seq-mean-token-sum-norm")
    with pytest.raises(InvalidArgument, match="loss_agg_mode"):
        agg_loss(LOSS_MAT, LOSS_MASK, "token-sum-ish")
    with pytest.raises(InvalidArgument, match="LossScale"):
        agg_loss(LOSS_MAT, LOSS_MASK, "token-mean", LossScale(0, 1, 1))


# Five tokens of one sequence: (A, ratio) chosen to hit every branch of the clipped objective.
PPO_ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
PPO_RATIO = [1.1, 1.5, 0.5, 5.0, 0.5]
PPO_MASK = torch.ones(1, 5)


def test_ppo_clip_every_branch() -> None:
    old = torch.zeros(1, 5)
    logp = torch.tensor([[math.log(r) for r in PPO_RATIO]], requires_grad=True)
    loss, metrics = ppo_clip_loss(old, logp, PPO_ADV, PPO_MASK, 0.2, 0.2, 3.0)
    # A=+1 r=1.1 inside: -1.1 | A=+1 r=1.5 clipped: -1.2 | A=-1 r=.5 clipped: 0.8
    # A=-1 r=5: max(5, 1.2) = 5 then dual clip min(5, 3) = 3 | A=+1 r=.5: max(-.5, -.8) = -.5
    assert loss.detach().tolist()[0] == pytest.approx([-1.1, -1.2, 0.8, 3.0, -0.5], abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(math.log(r) for r in PPO_RATIO) / 5, abs=1e-6)
    loss.sum().backward()
    # d(-A r)/dlogp = -A r where unclipped, 0 where a clip is active
    assert logp.grad is not None
    assert logp.grad.tolist()[0] == pytest.approx([-1.1, 0.0, 0.0, 0.0, -0.5], abs=1e-6)


def test_ppo_clip_higher() -> None:
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.25), math.log(0.75)]])
    adv = torch.tensor([[1.0, -1.0]])
    sym, _ = ppo_clip_loss(old, logp, adv, torch.ones(1, 2), 0.2, 0.2)
    dapo, m = ppo_clip_loss(old, logp, adv, torch.ones(1, 2), 0.2, 0.28)
    assert sym.tolist()[0] == pytest.approx([-1.2, 0.8])  # both clipped
    assert dapo.tolist()[0] == pytest.approx([-1.25, 0.8])  # 1.25 < 1.28: not clipped any more
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)


def test_ppo_is_weights_multiply_the_clipped_term() -> None:
    old = torch.zeros(1, 5)
    logp = torch.tensor([[math.log(r) for r in PPO_RATIO]])
    w = torch.tensor([[0.5, 2.0, 1.0, 0.0, 1.0]])
    loss, _ = ppo_clip_loss(old, logp, PPO_ADV, PPO_MASK, 0.2, 0.2, 3.0, is_weights=w)
    assert loss.tolist()[0] == pytest.approx([-0.55, -2.4, 0.8, 0.0, -0.5], abs=1e-6)


def test_gspo_sequence_ratio_and_gradient() -> None:
    old = logs([[0.5, 0.5], [0.5, 0.5]])
    logp = logs([[0.6, 0.4], [0.9, 0.9]]).requires_grad_()
    adv = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    mask = torch.ones(2, 2)
    loss, metrics = gspo_loss(old, logp, adv, mask, 0.2, 0.2)
    s1 = math.sqrt(1.2 * 0.8)  # geometric mean of the token ratios 1.2 and 0.8
    # seq 0: s=0.9798 inside the clip -> -s per token; seq 1: s=1.8 clipped to 1.2 -> -1.2
    assert loss.detach().tolist() == [pytest.approx([-s1, -s1], abs=1e-6), pytest.approx([-1.2, -1.2], abs=1e-6)]
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    agg_loss(loss, mask, "seq-mean-token-mean").backward()
    # each token of seq 0 gets -A * s * (1/2 tokens) * (1/2 seqs); clipped seq 1 gets nothing
    assert logp.grad is not None
    assert logp.grad.tolist() == [pytest.approx([-s1 / 4, -s1 / 4], abs=1e-6), pytest.approx([0.0, 0.0])]


def test_reinforce_loss() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -2.0]])
    adv = torch.tensor([[2.0, -1.0]])
    w = torch.tensor([[0.5, 1.0]])
    loss, metrics = reinforce_loss(rollout, logp, adv, torch.ones(1, 2), w)
    assert loss.detach().tolist()[0] == pytest.approx([1.0, -2.0])  # -A w log pi: -(2)(.5)(-1), -(-1)(1)(-2)
    assert metrics["actor/ppo_kl"] == pytest.approx(((-1.5 + 1.0) + 0.0) / 2)
    loss.sum().backward()
    assert logp.grad is not None
    assert logp.grad.tolist()[0] == pytest.approx([-1.0, 1.0])  # -A w


@pytest.mark.parametrize(
    ("kind", "p", "ref", "value"),
    [
        ("kl", 0.5, 0.25, math.log(2)),
        ("k1", 0.25, 0.5, -math.log(2)),
        ("abs", 0.25, 0.5, math.log(2)),
        ("mse", 0.5, 0.25, 0.5 * math.log(2) ** 2),
        ("k2", 0.25, 0.5, 0.5 * math.log(2) ** 2),
        ("low_var_kl", 0.5, 0.25, 0.5 + math.log(2) - 1),  # ref/p - log(ref/p) - 1
        ("k3", 0.25, 0.5, 2.0 - math.log(2) - 1),
    ],
)
def test_kl_estimators(kind: str, p: float, ref: float, value: float) -> None:
    out = kl_penalty(torch.tensor([math.log(p)]), torch.tensor([math.log(ref)]), kind)
    assert out.item() == pytest.approx(value, abs=1e-6)


def test_kl_straight_through_plus_variant() -> None:
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])
    plain = kl_penalty(logp, ref, "k3")
    (g_plain,) = torch.autograd.grad(plain.sum(), logp)
    plus = kl_penalty(logp, ref, "k3+")
    (g_plus,) = torch.autograd.grad(plus.sum(), logp)
    assert plus.item() == pytest.approx(plain.item())
    assert g_plain.item() == pytest.approx(1 - 0.5)  # d/dlogp [ref/p - log(ref/p) - 1] = 1 - ref/p
    assert g_plus.item() == pytest.approx(math.log(2))  # k2's gradient: log p - log ref
    with pytest.raises(InvalidArgument, match="unknown KL"):
        kl_penalty(logp, ref, "k9")


def loss_batch():
    """Two sequences; token 0 is prompt. Ratios 1.1 and 1.5 (A=+1), 0.5 and 5.0 (A=-1)."""
    mask = mask_rows([[0, 1, 1], [0, 1, 1]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[0.0, 1.0, 1.0], [0.0, -1.0, -1.0]])
    ref = torch.tensor([[0.0, math.log(1.1) - 1.0, math.log(1.5)], [0.0, math.log(0.5), math.log(5.0) + 0.5]])
    batch = make_batch(mask, rewards=[1, 0], groups=[0, 0], advantages=adv, old_logprobs=old, ref_logprobs=ref)
    logp = torch.tensor([[0.0, math.log(1.1), math.log(1.5)], [0.0, math.log(0.5), math.log(5.0)]])
    entropy = torch.tensor([[9.0, 1.0, 2.0], [9.0, 3.0, 4.0]])
    return batch, logp, entropy


def test_composed_loss_token_mean() -> None:
    batch, logp, entropy = loss_batch()
    actor = ActorConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1")
    fn = build_loss_fn(actor, AlgorithmConfig())
    loss, m = fn(ForwardOutput(logp, entropy), batch, LossScale(num_tokens=4, num_seqs=2, dp_size=1))
    pg = (-1.1 - 1.2 + 0.8 + 3.0) / 4
    ent = (1 + 2 + 3 + 4) / 4
    kl = (1.0 + 0.0 + 0.0 - 0.5) / 4  # k1 = logp - ref per response token
    assert m["actor/pg_loss"] == pytest.approx(pg, abs=1e-6)
    assert m["actor/entropy"] == pytest.approx(ent)
    assert m["actor/kl_loss"] == pytest.approx(kl, abs=1e-6)
    assert m["actor/kl_coef"] == pytest.approx(0.1)
    assert m["actor/pg_clipfrac"] == pytest.approx(2 / 4)
    assert loss.item() == pytest.approx(pg - 0.01 * ent + 0.1 * kl, abs=1e-6)
    # bypass mode with old == behaviour: the mismatch is that of pi_theta against the rollout
    assert m["rollout_corr/mismatch_kl"] == pytest.approx(-(math.log(1.1 * 1.5 * 0.5 * 5.0)) / 4, abs=1e-6)


def test_composed_loss_seq_mean_token_sum_norm_and_dp_factor() -> None:
    batch, logp, entropy = loss_batch()
    actor = ActorConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=8)
    loss, m = build_loss_fn(actor, AlgorithmConfig())(
        ForwardOutput(logp, entropy), batch, LossScale(num_tokens=40, num_seqs=5, dp_size=2)
    )
    seq_sums = (-1.1 - 1.2) + (0.8 + 3.0)
    assert loss.item() == pytest.approx(seq_sums / 5 * 2 / 8, abs=1e-6)
    assert m["actor/pg_loss"] == pytest.approx(seq_sums / 2 / 8, abs=1e-6)  # own normalizers, no dp factor


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_composed_loss_gspo_follows_loss_agg_mode(mode: str) -> None:
    """verl 0.9.1: compute_policy_loss_gspo aggregates with the actor's loss_agg_mode."""
    batch, logp, _ = loss_batch()
    actor = ActorConfig(policy_loss=PolicyLossConfig(loss_mode="gspo"), loss_agg_mode=mode)  # type: ignore[arg-type]
    loss, m = build_loss_fn(actor, AlgorithmConfig())(ForwardOutput(logp, None), batch, LossScale(4, 2, 1))
    s0 = math.sqrt(1.1 * 1.5)  # 1.2845 > 1.2: clipped for A=+1 -> -1.2 on each token of seq 0
    s1 = math.sqrt(0.5 * 5.0)  # 1.5811, A=-1: max(1.5811, 1.2) = 1.5811 (no dual clip) on seq 1
    assert s0 > 1.2
    mat = torch.tensor([[0.0, -1.2, -1.2], [0.0, s1, s1]])
    assert loss.item() == pytest.approx(agg_loss(mat, batch.response_mask, mode, LossScale(4, 2, 1)).item(), abs=1e-6)
    assert m["actor/pg_loss"] == pytest.approx(loss.item(), abs=1e-6)
    expected = {"token-mean": (-2.4 + 2 * s1) / 4, "seq-mean-token-mean": (-1.2 + s1) / 2, "seq-mean-token-sum": (-2.4 + 2 * s1) / 2}
    assert loss.item() == pytest.approx(expected[mode], abs=1e-6)


def test_gspo_token_mean_and_seq_mean_differ_on_ragged_sequences() -> None:
    """On sequences of unequal length the two modes weigh tokens differently: the switch acts."""
    mask = mask_rows([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    batch = make_batch(mask, advantages=adv, old_logprobs=torch.zeros(2, 3))
    logp = torch.zeros(2, 3)
    out = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        actor = ActorConfig(policy_loss=PolicyLossConfig(loss_mode="gspo"), loss_agg_mode=mode)  # type: ignore[arg-type]
        loss, _ = build_loss_fn(actor, AlgorithmConfig())(ForwardOutput(logp, None), batch, LossScale(4, 2, 1))
        out[mode] = loss.item()
    assert out["token-mean"] == pytest.approx((-3 + 1) / 4)  # ratio 1: l = -A per token
    assert out["seq-mean-token-mean"] == pytest.approx((-1 + 1) / 2)


def test_loss_fn_errors_name_the_problem() -> None:
    batch, logp, entropy = loss_batch()
    with pytest.raises(InvalidArgument, match="entropy"):
        build_loss_fn(ActorConfig(entropy_coeff=0.01), AlgorithmConfig())(ForwardOutput(logp, None), batch, LossScale(4, 2, 1))
    del batch.tensors["ref_logprobs"]
    with pytest.raises(InvalidArgument, match="ref_logprobs"):
        build_loss_fn(ActorConfig(use_kl_loss=True), AlgorithmConfig())(ForwardOutput(logp, entropy), batch, LossScale(4, 2, 1))
    with pytest.raises(InvalidArgument, match="loss_scale_factor"):
        build_loss_fn(ActorConfig(loss_agg_mode="seq-mean-token-sum-norm"), AlgorithmConfig())
    with pytest.raises(InvalidArgument, match="shape"):
        build_loss_fn(ActorConfig(), AlgorithmConfig())(ForwardOutput(logp[:, :2], None), batch, LossScale(4, 2, 1))


def test_metrics_to_floats_keeps_order_and_plain_floats() -> None:
    from services.trainer.algos.agg import metrics_to_floats

    out = metrics_to_floats({"a": torch.tensor(1.5), "b": 2.0, "c": torch.tensor([3.0])})
    assert out == {"a": 1.5, "b": 2.0, "c": 3.0} and list(out) == ["a", "b", "c"]
    assert metrics_to_floats({}) == {}


def test_config_fills_loss_scale_factor_from_max_response_length() -> None:
    from services.common.config import load_config

    cfg = load_config(None, ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", "data.max_response_length=96"])
    assert cfg.actor_rollout_ref.actor.loss_scale_factor == 96
    cfg = load_config(None, ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", "actor_rollout_ref.actor.loss_scale_factor=4"])
    assert cfg.actor_rollout_ref.actor.loss_scale_factor == 4
    build_loss_fn(cfg.actor_rollout_ref.actor, cfg.algorithm)  # accepted
