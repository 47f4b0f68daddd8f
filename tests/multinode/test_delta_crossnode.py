"""Delta sync between nodes: `meshrl bench weights-delta --cross-node` on the tier's cluster, small.
The gloo sender runs in node c's namespace, the receiver in node b's, their param server in node a's
(processes entered into the namespaces, no Ray): the group forms on the address c reaches a from,
every version crosses the veths, deltas after the first are rebuilt bit for bit on b. Times are not
asserted (2 shared cores)."""

from __future__ import annotations

import pytest

from meshrl.bench.weights_delta import run_benchmark
from meshrl.netns_cluster import NetnsCluster

pytestmark = pytest.mark.multinode


@pytest.mark.timeout(600)
def test_delta_sync_over_gloo_between_namespaces(cluster: NetnsCluster) -> None:
    result = run_benchmark(size_gb=1 / 16, bucket_mb=32, rounds=3, lrs=(1e-6,), backend="gloo", cluster=cluster)
    placed = result["placement"]
    assert placed["param_server"].rsplit(":", 1)[0] == cluster.ip("a")
    assert placed["sender_master"] == cluster.ip("c")  # the group's store and gloo device: on c's veth
    whole, delta = result["cases"]["whole@lr=1e-06"], result["cases"]["delta@lr=1e-06"]
    assert whole["identical"] and delta["identical"], result["cases"]  # b rebuilt the walk's last version
    # ~1% of the bf16 elements change per version at this step size; each version after the
    # first travels as its changes, a small share of the bytes
    assert all(0 < f < 0.05 for f in delta["changed_fraction"]), delta
    assert all(0 < f < 0.5 for f in delta["sent_fraction"]), delta
    assert delta["first_version"]["sent_fraction"] == pytest.approx(1.0, abs=0.01), delta["first_version"]
