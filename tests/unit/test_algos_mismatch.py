"""The train/infer mismatch split by generating version (services/trainer/algos/mismatch.py)."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.config.actor_rollout_ref import ActorConfig
from services.common.config.algorithm import AlgorithmConfig
from services.trainer.algos import build_loss_fn
from services.trainer.algos.mismatch import VERSION_MASK_KEY, finish_loss_sums, split_metrics, version_mask
from services.trainer.engines.base import ForwardOutput, LossScale
from tests.unit.algo_helpers import make_batch, mask_rows


def test_version_mask_follows_the_batch_layout() -> None:
    # row 0: prompt of 2, tokens at versions 3, 4, 4; row 1: prompt of 1, tokens at 4, 4 (a partial rollout)
    mask = version_mask([(2, [3, 4, 4]), (1, [4, 4])], (2, 6), 4)
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="do not fit"):
        version_mask([(2, [3, 4, 4])], (2, 6), 4)


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row 0 at the trainer's version (engine mismatch d = 0.1 per token); row 1 stale (d = 1.0)."""
    mask = mask_rows([[0, 1, 1, 1], [0, 1, 1, 0]])
    at = mask_rows([[0, 1, 1, 1], [0, 0, 0, 0]])
    train = torch.full((2, 4), -1.0)
    rollout = train + torch.tensor([[0.0, 0.1, 0.1, 0.1], [0.0, 1.0, 1.0, 0.0]])
    return train, rollout, mask, at


def test_split_separates_engine_mismatch_from_staleness() -> None:
    train, rollout, mask, at = _case()
    m = split_metrics(train, rollout, mask, at)
    k3 = lambda d: math.exp(-d) - 1 + d  # noqa: E731
    assert m["rollout_corr/engine_token_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_corr/engine_mismatch_kl"] == pytest.approx(0.1, rel=1e-5)
    assert m["rollout_corr/engine_mismatch_k3_kl"] == pytest.approx(k3(0.1), rel=1e-4)
    assert m["rollout_corr/offpolicy_kl"] == pytest.approx(1.0)
    assert m["rollout_corr/offpolicy_k3_kl"] == pytest.approx(k3(1.0))
    # no token at the trainer's version: the engine metrics are absent, not 0
    none = split_metrics(train, rollout, mask, torch.zeros_like(at))
    assert "rollout_corr/engine_mismatch_kl" not in none and none["rollout_corr/engine_token_fraction"] == 0.0


def test_bypass_loss_sums_averaged_over_micro_batches_give_the_whole_batch_ratios() -> None:
    """The engines average every metric over micro-batches and ranks; the split survives that."""
    train, rollout, mask, at = _case()
    batch = make_batch(mask, advantages=torch.zeros(2, 4), old_logprobs=rollout)
    batch.tensors[VERSION_MASK_KEY] = at
    loss_fn = build_loss_fn(ActorConfig(), AlgorithmConfig())
    assert AlgorithmConfig().rollout_correction.bypass_mode
    per_mb = [
        loss_fn(ForwardOutput(train[i : i + 1], None), batch.select([i]), LossScale(5, 2, 1))[1] for i in range(2)
    ]
    keys = set(per_mb[0]) & set(per_mb[1])
    averaged = {k: sum(m[k] for m in per_mb) / 2 for k in keys}
    out = finish_loss_sums(averaged)
    assert not any(k.startswith("rollout_corr/_sum_") for k in out)
    for k, v in split_metrics(train, rollout, mask, at).items():
        assert out[k] == pytest.approx(v, rel=1e-6), k
    # without the mask (later mini-batches, decoupled mode) the loss emits no sums
    batch.tensors.pop(VERSION_MASK_KEY)
    _, plain = loss_fn(ForwardOutput(train, None), batch, LossScale(5, 2, 1))
    assert finish_loss_sums(plain) == plain and "rollout_corr/engine_mismatch_kl" not in plain
