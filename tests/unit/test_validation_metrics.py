"""Validation metrics per data_source, under verl's names (val-core/<source>/<var>/mean@N)."""

from __future__ import annotations

import pytest

from meshrl.validation import ValPrompt, per_source_metrics

pytestmark = pytest.mark.unit


def test_a_mixed_set_is_reported_per_source_with_each_scorers_own_metrics() -> None:
    prompts = [
        # GSM8K-like scorer: reports acc and format
        ValPrompt("openai/gsm8k", [{"reward": 1.0, "acc": 1.0, "format": 1.0}]),
        ValPrompt("openai/gsm8k", [{"reward": 0.0, "acc": 0.0, "format": 1.0}]),
        # the synthetic scorer: digit_match and a format of its own definition
        ValPrompt("meshrl/addition", [{"reward": 1.0, "digit_match": 1.0, "format": 0.0}]),
    ]
    m = per_source_metrics(prompts, n=1)
    assert m["val-core/openai/gsm8k/acc/mean@1"] == 0.5
    assert m["val-aux/openai/gsm8k/reward/mean@1"] == 0.5
    assert m["val-aux/openai/gsm8k/format/mean@1"] == 1.0
    assert m["val-core/meshrl/addition/reward/mean@1"] == 1.0  # no acc: reward is the core variable
    assert m["val-aux/meshrl/addition/format/mean@1"] == 0.0  # never pooled with gsm8k's format
    assert m["val-aux/meshrl/addition/digit_match/mean@1"] == 1.0
    assert not any("gsm8k/digit_match" in k for k in m)
    assert not any("@1" in k and ("best" in k or "std" in k) for k in m)


def test_n_samples_per_prompt_give_mean_std_best_worst() -> None:
    prompts = [
        ValPrompt("a", [{"reward": 1.0}, {"reward": 0.0}, {"reward": 0.0}, {"reward": 1.0}]),
        ValPrompt("a", [{"reward": 0.0}] * 4),
    ]
    m = per_source_metrics(prompts, n=4)
    assert m["val-core/a/reward/mean@4"] == pytest.approx(0.25)
    assert m["val-core/a/reward/best@4/mean"] == pytest.approx(0.5)
    assert m["val-aux/a/reward/worst@4/mean"] == 0.0
    assert m["val-aux/a/reward/std@4"] == pytest.approx(0.25)  # (0.5 + 0) / 2
