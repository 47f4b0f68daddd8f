"""Collective groups between nodes, in processes entered into the tier's namespaces (no Ray): delta
sync (`meshrl bench weights-delta --cross-node`, small), and a trainer's CPU process group.

Delta sync:
The gloo sender runs in node c's namespace, the receiver in node b's, their param server in node a's
(processes entered into the namespaces, no Ray): the group forms on the address c reaches a from,
every version crosses the veths, deltas after the first are rebuilt bit for bit on b. Times are not
asserted (2 shared cores)."""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import pytest

from meshrl.bench.weights_delta import run_benchmark
from meshrl.netns_cluster import NetnsCluster, run_in_netns

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


def _rank(rank: int, master: str, port: int, out: Any) -> None:
    """A trainer rank's process group as `TrainWorker.init_engine` joins it (CPU: gloo)."""
    import torch
    import torch.distributed as dist

    from services.trainer.engines.dist import init_process_group
    from services.trainer.ranks import rank_environment

    os.environ.update(rank_environment(rank, 2, master, port))
    got, _ = init_process_group("cpu", 60.0)
    t = torch.tensor([got + 1.0])
    dist.all_reduce(t)
    out.put((got, os.environ.get("GLOO_SOCKET_IFNAME"), t.item()))
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_trainer_ranks_on_two_nodes_form_their_cpu_group(cluster: NetnsCluster) -> None:
    """Rank 0 on c (the master), rank 1 on b: each listens on the interface toward the master
    (the hostname resolves to loopback here, as in many containers: torch's default fails)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run_in_netns, args=(cluster.nodes[node].netns, _rank, rank, cluster.ip("c"), 29533, out),
                         daemon=True) for rank, node in ((0, "c"), (1, "b"))]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [(r, total) for r, _, total in got] == [(0, 3.0), (1, 3.0)], got
    assert all(ifname not in (None, "lo") for _, ifname, _ in got), got  # each node's veth
