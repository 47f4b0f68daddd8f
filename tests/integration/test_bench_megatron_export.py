"""`meshrl bench megatron-export` on CPU (gloo, 2 TP ranks, a small random Qwen3): both exports
run, carry the same bytes and the same weights (a check of the benchmark, not a measurement)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")


def test_both_exports_carry_the_same_weights_over_two_tp_ranks() -> None:
    from meshrl.bench.megatron_export import CASES, run_benchmark

    r = run_benchmark(tp=2, hidden=256, layers=2, rounds=1, bucket_mb=1, device="cpu")
    assert r["all_cases_same_weights"] is True
    assert r["bytes"]["rank0"] == r["bytes"]["own_slices"] > 0
    assert set(r["median_s"]) == set(CASES) and all(len(r["seconds"][c]) == 1 for c in CASES)
    assert r["own_slices_over_rank0"] == pytest.approx(r["median_s"]["own_slices"] / r["median_s"]["rank0"])
