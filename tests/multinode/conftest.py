"""The `multinode` tier: one 3-node Ray cluster (meshrl/netns_cluster.py, a network namespace per
node) for the whole tier, made here and removed here, also when a test fails.

    node a (head): {node_a}  coordinator, param_server (data plane 0.0.0.0:50071), Serve controller
    node b       : {node_b}  two rollout replicas
    node c       : {node_c}  the trainer replica and its rank

Needs root and iproute2 (CI runs as root); elsewhere the tier skips with the reason.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import pytest

from meshrl.netns_cluster import NetnsCluster, unavailable_reason

# Logical CPUs per node: placement, not speed (the machine has what it has). Node b holds two
# rollout replicas, node c the trainer's replica and its rank (and, after a loss, the rank's old
# placement group until Ray removes it).
NODE_CPUS = {"a": 4, "b": 4, "c": 4}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multinode tier: {reason}")
    work = tmp_path_factory.mktemp("cluster")
    # SIGTERM (CI's timeout, a killed job) must still run close(): namespaces outlive processes.
    previous = signal.getsignal(signal.SIGTERM)

    def _terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _terminate)
    c = NetnsCluster(["a", "b", "c"], work_dir=work, num_cpus=NODE_CPUS, object_store_mb=256)
    try:
        c.start()
        yield c
    finally:
        c.close()
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGTERM, previous)  # type: ignore[arg-type]
