"""Properties: the micro-batch / data-parallel loss convention is exact for every aggregation mode
and loss variant; on-policy zero advantages give zero loss; group baselines sum to zero."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.config.actor_rollout_ref import ActorConfig, PolicyLossConfig
from services.common.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from services.trainer.algos import AGG_MODES, build_loss_fn, compute_advantages, loss_scale_counts
from services.trainer.engines.base import ForwardOutput, LossScale, SequenceBatch
from tests.unit.algo_helpers import make_batch

VARIANTS = ("vanilla", "gspo", "bypass_reinforce", "decoupled_is_rs", "bypass_rs")
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def configs(variant: str, mode: str) -> tuple[ActorConfig, AlgorithmConfig]:
    actor = ActorConfig(
        loss_agg_mode=mode,  # type: ignore[arg-type]
        loss_scale_factor=7,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.05,
        kl_loss_type="low_var_kl",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        policy_loss=PolicyLossConfig(loss_mode="gspo" if variant == "gspo" else "vanilla"),
    )
    rc = RolloutCorrectionConfig()
    if variant == "bypass_reinforce":
        rc = RolloutCorrectionConfig(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.0)
    elif variant == "decoupled_is_rs":
        rc = RolloutCorrectionConfig(
            bypass_mode=False, rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05
        )
    elif variant == "bypass_rs":
        rc = RolloutCorrectionConfig(rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="1.5,0.3")
    return actor, AlgorithmConfig(rollout_correction=rc)


def random_batch(seed: int, b: int, length: int) -> tuple[SequenceBatch, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, length)
    for i in range(b):
        start = int(torch.randint(1, length - 1, (1,), generator=g))
        end = int(torch.randint(start, length + 1, (1,), generator=g))  # end == start: no response
        mask[i, start:end] = 1
    if mask.sum() == 0:
        mask[0, 1] = 1

    def tok(scale: float) -> torch.Tensor:
        return (-torch.rand(b, length, generator=g) * scale - 0.05) * mask

    old = tok(2.0)
    rollout = old + torch.randn(b, length, generator=g) * 0.3 * mask
    ref = old + torch.randn(b, length, generator=g) * 0.2 * mask
    logp = old + torch.randn(b, length, generator=g) * 0.3 * mask
    adv = torch.randn(b, 1, generator=g) * mask
    entropy = torch.rand(b, length, generator=g) * 3
    batch = make_batch(
        mask,
        rewards=[0.0] * b,
        groups=list(range(b)),
        advantages=adv,
        old_logprobs=old,
        rollout_logprobs=rollout,
        ref_logprobs=ref,
    )
    return batch, logp, entropy


@st.composite
def split_plans(draw: st.DrawFn) -> tuple[int, int, int, list[list[list[int]]]]:
    seed = draw(st.integers(0, 2**31 - 1))
    b = draw(st.integers(2, 9))
    length = draw(st.integers(3, 8))
    dp = draw(st.integers(1, 3))
    order = draw(st.permutations(list(range(b))))
    # cut the permutation into dp ranks, each into micro-batches (empty ones are skipped)
    cuts = sorted(draw(st.lists(st.integers(0, b), min_size=dp - 1, max_size=dp - 1)))
    bounds = [0, *cuts, b]
    ranks = []
    for r in range(dp):
        rows = list(order[bounds[r] : bounds[r + 1]])
        mb_size = draw(st.integers(1, 4))
        ranks.append([rows[i : i + mb_size] for i in range(0, len(rows), mb_size)])
    return seed, b, length, ranks


@pytest.mark.parametrize("mode", AGG_MODES)
@given(plan=split_plans(), variant=st.sampled_from(VARIANTS))
@FAST
def test_micro_batches_over_ranks_equal_the_full_batch(mode: str, plan, variant: str) -> None:
    seed, b, length, ranks = plan
    batch, logp0, ent0 = random_batch(seed, b, length)
    loss_fn = build_loss_fn(*configs(variant, mode))
    dp = len(ranks)
    tokens, seqs = loss_scale_counts(batch)

    logp = logp0.clone().requires_grad_()
    ent = ent0.clone().requires_grad_()
    full, _ = loss_fn(ForwardOutput(logp, ent), batch, LossScale(tokens, seqs, 1))
    full.backward()
    assert logp.grad is not None and ent.grad is not None
    g_logp, g_ent = logp.grad.clone(), ent.grad.clone()

    logp = logp0.clone().requires_grad_()
    ent = ent0.clone().requires_grad_()
    scale = LossScale(tokens, seqs, dp)
    total = torch.zeros(())
    for rank in ranks:  # each rank sums its micro-batch losses; DP then averages over ranks
        for rows in rank:
            idx = torch.tensor(rows)
            loss, _ = loss_fn(ForwardOutput(logp[idx], ent[idx]), batch.select(idx), scale)
            total = total + loss
    (total / dp).backward()
    assert (total / dp).item() == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(logp.grad, g_logp, rtol=1e-5, atol=1e-7)
    assert torch.allclose(ent.grad, g_ent, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", AGG_MODES)
@given(seed=st.integers(0, 2**31 - 1), variant=st.sampled_from(("vanilla", "gspo", "bypass_reinforce", "bypass_rs")))
@FAST
def test_on_policy_zero_advantage_gives_zero_pg_loss(mode: str, seed: int, variant: str) -> None:
    batch, _, _ = random_batch(seed, 5, 6)
    batch.tensors["advantages"] = torch.zeros_like(batch.response_mask)
    logp = batch.tensors["old_logprobs"].clone().requires_grad_()  # ratio 1
    actor, algo = configs(variant, mode)
    actor = actor.model_copy(update={"entropy_coeff": 0.0, "use_kl_loss": False})
    tokens, seqs = loss_scale_counts(batch)
    loss, metrics = build_loss_fn(actor, algo)(ForwardOutput(logp, None), batch, LossScale(tokens, seqs, 1))
    loss.backward()
    assert loss.item() == 0.0 and metrics["actor/pg_loss"] == 0.0
    assert logp.grad is not None and torch.count_nonzero(logp.grad) == 0
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)


def test_on_policy_ppo_gradient_is_the_policy_gradient() -> None:
    batch, _, _ = random_batch(3, 6, 7)
    logp = batch.tensors["old_logprobs"].clone().requires_grad_()
    tokens, seqs = loss_scale_counts(batch)
    loss, metrics = build_loss_fn(ActorConfig(), AlgorithmConfig())(ForwardOutput(logp, None), batch, LossScale(tokens, seqs, 1))
    loss.backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad, -batch.tensors["advantages"] * batch.response_mask / tokens, atol=1e-7)
    assert metrics["actor/pg_clipfrac"] == 0.0


@given(
    rewards=st.lists(st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=2, max_size=6), min_size=1, max_size=5),
    estimator=st.sampled_from(("grpo", "drgrpo", "rloo")),
)
@settings(max_examples=40, deadline=None)
def test_group_advantages_sum_to_zero(rewards: list[list[float]], estimator: str) -> None:
    flat = [r for group in rewards for r in group]
    groups = [g for g, group in enumerate(rewards) for _ in group]
    mask = torch.zeros(len(flat), 3)
    mask[:, 1] = 1
    batch = make_batch(mask, rewards=flat, groups=groups)
    adv = compute_advantages(batch, AlgorithmConfig(adv_estimator=estimator))[:, 1]  # type: ignore[arg-type]
    for g, group in enumerate(rewards):
        sel = torch.tensor(groups) == g
        spread = max(group) - min(group)
        assert adv[sel].sum().item() == pytest.approx(0.0, abs=1e-4 * max(1.0, abs(adv[sel]).max().item()))
        if estimator == "grpo" and spread > 1e-3:
            # (r - mean) / (std + eps): the normalised std is std / (std + eps), not exactly 1
            std = torch.tensor(group, dtype=torch.float32).std().item()
            assert adv[sel].std().item() == pytest.approx(std / (std + 1e-6), rel=1e-3)
