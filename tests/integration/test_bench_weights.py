"""`meshrl bench weights` end to end at a tiny size: every case runs and reports."""

from __future__ import annotations

import json

import pytest

from meshrl.bench.weights import plan_sizes, run_benchmark
from meshrl.cli import main


def test_bench_weights_small(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert sum(n for b in plan_sizes(10 << 20, 4 << 20) for _, _, n in b) == 10 << 20
    out = tmp_path / "weights.json"
    assert main(["bench", "weights", "--size-gb", str(8 / 1024), "--bucket-mb", "4", "--rounds", "1",
                 "--warmup-rounds", "1", "--transports", "grpc,disk", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bytes"] == 8 << 20 and r["baselines"]["memcpy"]["best_GBps"] > 0 and r["warmup_rounds"] == 1
    assert r["baselines"]["memcpy"]["best_s"] == min(r["baselines"]["memcpy_best_s_before_after"])
    case_grpc = r["transports"]["grpc"]
    for name in ("grpc", "disk"):
        case = r["transports"][name]
        assert "error" not in case, case
        assert case["publish"]["best_GBps"] > 0 and case["fetch"]["best_GBps"] > 0 and len(case["rounds"]) == 3
        assert len(case["publish"]["warmup_s"]) == 1 and case["publish"]["cold_GBps"] > 0  # cold, warm-up, steady
    assert set(r["targets"]) == {"grpc_ge_1GBps"} and r["targets"]["grpc_ge_1GBps"]["cold_GBps"]["fetch"] > 0
    # grpc's yardstick, same run: grpc.aio alone moved the same bytes both ways (it asserts the count)
    bare = r["baselines"]["grpc_bare"]
    assert "error" not in bare, bare
    assert len(bare["rounds"]) == 3 and bare["publish"]["best_GBps"] > 0 and bare["fetch"]["best_GBps"] > 0
    # both of its processes tuned malloc as the transport's do (glibc Linux: this machine, CI)
    assert bare["malloc_tuned"] is True
    ratio = r["targets"]["grpc_ge_1GBps"]["ratio_to_bare_median"]
    assert ratio["fetch"] == round(case_grpc["fetch"]["median_GBps"] / bare["fetch"]["median_GBps"], 3) > 0
    assert "\"benchmark\": \"weights\"" in capsys.readouterr().out


def test_bench_weights_object_store_reports_warmup_and_fresh_memory_per_round(serve_grpc_port: int) -> None:
    """On the session's Ray: cold, warm-up and steady rounds apart, the /dev/shm each publish newly
    touched, and the target's steady ratio with the cold one beside it."""
    r = run_benchmark(size_gb=8 / 1024, bucket_mb=4, rounds=2, warmup_rounds=1, transports=("object_store",), hop=True)
    case = r["transports"]["object_store"]
    assert "error" not in case, case
    assert len(case["rounds"]) == 4 and len(case["end_to_end"]["warmup_s"]) == 1
    assert len(case["shm_growth_bytes"]) == 4 and all(b >= 0 for b in case["shm_growth_bytes"])
    t = r["targets"]["object_store_ge_50pct_memcpy"]
    assert t["ratio_best"] > 0 and t["ratio_cold"] > 0 and t["memcpy_fresh_GBps"] > 0 and isinstance(t["met"], bool)
    # the export's packing, with and without its fingerprint, and the ratio with that fingerprint paid
    export = r["export"]
    assert export["source_device"] == "cpu" and export["pack_best_s"] > 0 and export["copy_best_s"] > 0
    # each of the three is rounded to 0.1 ms on its own: their difference may be off by up to 0.15 ms
    assert export["fingerprint_s"] == pytest.approx(max(0.0, export["pack_best_s"] - export["copy_best_s"]), abs=2e-4)
    assert 0 < t["with_export_fingerprint"]["ratio_best"] <= t["ratio_best"]
    # a version from a rank actor: the wire form, torch's pickling and the put/get baseline, each timed
    hop = r["hop"]
    assert "error" not in hop, hop
    assert all(hop[k]["best_s"] > 0 and len(hop[k]["s"]) == 3 for k in ("wire", "torch_pickle", "put_get"))
    ranked = case["from_rank"]  # the same version from a rank: registered as it crossed vs put again
    assert all(len(ranked[k]["rounds"]) == 4 and ranked[k]["end_to_end"]["best_s"] > 0 for k in ("registered", "put_again"))
    assert t["from_rank"]["registered_ratio_best"] > 0 and t["from_rank"]["put_again_ratio_best"] > 0
    speedup = hop["torch_pickle"]["best_s"] / hop["wire"]["best_s"]  # of the rounded seconds
    assert abs(hop["wire_speedup_vs_torch_pickle"] - speedup) <= 0.02 * speedup


def test_run_benchmark_reports_a_failing_transport_without_losing_the_others() -> None:
    r = run_benchmark(size_gb=1 / 1024, bucket_mb=1, rounds=0, transports=("disk", "nccl"))
    assert "publish" in r["transports"]["disk"]
    import torch

    if not torch.cuda.is_available():
        assert "error" in r["transports"]["nccl"]


def test_bench_weights_sharded_runs_every_case_on_gloo(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The 4-process bench of rank-0 vs every-rank sync (meshrl/bench/weights_sharded.py), on CPU:
    the same code the GPU machine runs with nccl, so a broken case shows here first."""
    out = tmp_path / "sharded.json"
    assert main(["bench", "weights-sharded", "--backend", "gloo", "--size-gb", str(8 / 1024), "--bucket-mb", "4",
                 "--rounds", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["senders"] == 2 and r["receivers"] == 2 and r["bytes"] == 8 << 20
    for case in ("raw_rank0", "raw_sharded", "rank0", "sharded", "gather"):
        assert r["cases"][case]["best_GBps"] > 0, case
    assert set(r["ratios"]) >= {"sharded_vs_rank0_speedup_median", "sharded_of_raw_best"}


def test_bench_weights_delta_runs_both_cases_on_gloo(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`meshrl bench weights-delta` on CPU (gloo): whole and delta versions of the same walk, the
    last one rebuilt identically on the receiver, deltas smaller than the whole version."""
    out = tmp_path / "delta.json"
    assert main(["bench", "weights-delta", "--backend", "gloo", "--size-gb", str(16 / 1024), "--bucket-mb", "8",
                 "--rounds", "2", "--lrs", "1e-6", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["cases"]) == {"whole@lr=1e-06", "delta@lr=1e-06"}
    assert all(c["identical"] for c in r["cases"].values()), r["cases"]
    assert r["cases"]["delta@lr=1e-06"]["first_version"]["base_version"] == 0
    assert 0 < r["ratios"]["lr=1e-06"]["bytes_delta_over_whole_median"] < 0.5, r["ratios"]
