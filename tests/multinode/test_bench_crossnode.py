"""`meshrl bench weights --cross-node` on the tier's cluster, small: the grpc and object_store
transports move every byte between namespaces (publisher on c, param server on a, fetcher on b)
and the raw TCP baselines run on the same pairs. Numbers are not asserted (2 shared cores);
BENCHMARKS.md has a full-size run."""

from __future__ import annotations

import pytest

from meshrl.bench.crossnode import PAIRS, run_benchmark
from meshrl.bench.weights import GiB, MiB, plan_sizes
from meshrl.netns_cluster import NetnsCluster

pytestmark = pytest.mark.multinode


@pytest.mark.timeout(900)
def test_cross_node_weights_bench_moves_every_byte_between_namespaces(cluster: NetnsCluster) -> None:
    result = run_benchmark(size_gb=1 / 32, bucket_mb=16, rounds=1, cluster=cluster)  # one bucket per version
    assert result["cluster"]["ips"] == {n: cluster.ip(n) for n in ("a", "b", "c")}
    for src, dst in PAIRS:
        assert result["baselines"][f"raw_tcp_{src}_to_{dst}"]["best_GBps"] > 0
    for name in ("grpc", "object_store"):
        t = result["transports"][name]
        assert len(t["rounds"]) == 2 and t["fetch"]["best_GBps"] > 0 and t["publish"]["best_GBps"] > 0
    # put on c, read on b: every bucket crossed nodes, so every one was fingerprinted
    buckets = len(plan_sizes(GiB // 32, 16 * MiB))
    assert result["transports"]["object_store"]["verified_buckets"] == [buckets] * 2, result["transports"]["object_store"]
    assert set(result["ratios"]) == {"grpc_publish_c_to_a_vs_raw", "grpc_fetch_a_to_b_vs_raw",
                                     "object_store_fetch_c_to_b_vs_raw", "object_store_end_to_end_vs_raw_c_to_b"}
