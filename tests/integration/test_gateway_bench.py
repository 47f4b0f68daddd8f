"""`meshrl bench gateway` on a small workload: the real gateway on loopback, the tiny Qwen3 on the
transformers engine, the `openai` SDK as each session's agent. The keys the issue names are there,
and sessions_ok / sessions_failed come from what happened: one agent finishing with a wrong key
fails its session and, through its group's returned lease, its sibling; the other group's two
sessions come out whole."""

from __future__ import annotations

import math

from meshrl.bench.gateway import run_benchmark


def test_bench_gateway_counts_sessions_from_their_outcomes() -> None:
    out = run_benchmark(calls=2, rounds=2, max_tokens=6, sessions=4, group_size=2, calls_per_session=2, sabotage=1)
    for key in ("p50_overhead_ms", "p99_overhead_ms", "gateway_overhead_ms", "sessions_ok", "sessions_failed",
                "sessions_wall_s", "sessions_per_s", "sessions_call_ms"):
        assert key in out, key
    assert out["p50_overhead_ms"] == out["gateway_overhead_ms"]["p50"]
    assert out["sessions"] == 4 and out["sessions_ok"] == 2 and out["sessions_failed"] == 2, out
    assert out["sessions_failed_reasons"] == {"finish refused: HTTP 401": 1,
                                              "group failed: GatewayGroupFailed": 1}, out
    assert out["sessions_calls"] >= 6  # the ok group's 2 x 2 calls and the refused agent's 2 (its sibling may be cut)
    assert out["sessions_wall_s"] > 0 and out["sessions_per_s"] > 0
    assert all(math.isfinite(out["sessions_call_ms"][q]) for q in ("p50", "p99"))
