"""Packed (use_remove_padding) training with zero-weight dummy micro-batches: a rank with fewer
micro-batches than another, or with no sequence at all, runs a one-token dummy whose loss must
still back-propagate (FSDP2 reduce-scatters in the backward hooks of every rank)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.engines.batching import dummy_batch
from tests.unit.fsdp_helpers import GRAD_PROBE_OPTIM, build, fixed_batch, make_spec, run_ranks, run_scenario

PROBE = {"optim": GRAD_PROBE_OPTIM, "grad_clip": 1e9}
SCENARIOS: dict[str, dict[str, Any]] = {
    "packed_uneven": {**PROBE, "remove_padding": True, "micro": 1, "num_seqs": 3},
    "packed_empty_rank": {**PROBE, "remove_padding": True, "num_seqs": 1},
    "padded_empty_rank": {**PROBE, "remove_padding": False, "num_seqs": 1},
}


def test_packed_dummy_micro_batch_is_differentiable() -> None:
    engine: Any = build(make_spec(remove_padding=True))
    engine.model.train()
    out = engine._forward(engine.model, dummy_batch(1, engine.pad_token_id), 1.0, False)
    (out.logprobs.sum() * 0.0).backward()  # raised: element 0 of tensors does not require grad


def test_two_packed_ranks_with_dummies_match_one_rank(tmp_path: Path) -> None:
    ranks = run_ranks(2, SCENARIOS, tmp_path)
    for name, kw in SCENARIOS.items():
        n = kw["num_seqs"]
        ref = run_scenario(
            build(make_spec(**{k: v for k, v in kw.items() if k != "num_seqs"})), fixed_batch(num_seqs=n)
        )
        for r in ranks:
            assert r[name]["steps"][0]["grad_norm"] == pytest.approx(ref["steps"][0]["grad_norm"], rel=1e-4), name
        for k, want in ref["delta"].items():
            torch.testing.assert_close(ranks[0][name]["delta"][k], want, atol=2e-7, rtol=2e-3, msg=f"{name} {k}")
