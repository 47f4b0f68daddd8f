"""`meshrl serve-config` -> Ray's `serve deploy` onto a 3-node cluster (conftest.py), one short run
that loses node b (the rollouts) and then node c (the trainer), and still ends with every prompt
trained exactly once.

    serve deploy (REST, from this namespace to the head's dashboard)
      placement, checked where the processes are (the namespace each replica's process is in):
      a: coordinator, param_server   b: 2 x rollout   c: trainer + its rank   reward: anywhere
      weights: the trainer on c publishes to the param server's data plane on a
      (param_server.host=0.0.0.0: it advertises a's IP; the trainer and the rollouts ask for it),
      the rollouts on b fetch from it
    kill b (SIGKILL to every process of its namespace) while leases are in flight
      -> no node has node_b: the rollout replicas wait, unplaced; nothing generates
      -> their leases expire (coordinator.lease_timeout_s) and their prompts go back to retry
         (or, when the groups were faster than the kill, they were submitted: either is checked)
      -> b rejoins (`ray start` again): Serve starts both replicas there; the run goes on
    kill c after a checkpoint, with a step past it already delivered to the trainer
      -> the trainer is gone; the rollouts fill the queue up to the staleness budget and wait
      -> c rejoins: Serve restarts the trainer replica there; it resumes from the newest
         checkpoint and ResumeTrainer re-queues the groups delivered after it
    the run finishes; the ledger audit balances; `meshrl report` draws the run directory

Fixed ports (Serve's gRPC ingress, the param server's data plane) are safe here: they are bound
inside namespaces this test created, where nothing else listens.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from meshrl.netns_cluster import ROOT, NetnsCluster, namespace_pids
from meshrl.v1 import trainer_pb2, trainer_pb2_grpc
from services.coordinator.client import CoordinatorClient

pytestmark = pytest.mark.multinode

GRPC_PORT, HTTP_PORT, PS_PORT = 9000, 8000, 50071
STEPS, MINI_BATCH, N = 36, 8, 4  # long enough that both losses land mid-run (~3 s a step here)
PROMPTS = STEPS * MINI_BATCH
LEASE_TIMEOUT_S = 20.0
SAVE_FREQ = 2
WAIT_S = 420.0

PLACEMENT = [
    f"serve.grpc_port={GRPC_PORT}", f"serve.http_port={HTTP_PORT}",
    f"param_server.port={PS_PORT}", "param_server.host=0.0.0.0",  # the multi-node switch
    "serve.coordinator.resources={node_a: 1}", "serve.param_server.resources={node_a: 1}",
    "serve.rollout.resources={node_b: 1}", "serve.rollout.num_replicas=2",
    "serve.trainer.resources={node_c: 1}", "trainer_service.worker_resources={node_c: 1}",
]
RUN = [
    f"rollout.total_rollout_steps={PROMPTS}", f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_BATCH}",
    f"actor_rollout_ref.rollout.n={N}", f"trainer.save_freq={SAVE_FREQ}", "trainer.test_freq=-1",
    f"coordinator.lease_timeout_s={LEASE_TIMEOUT_S}",
    "async_training.concurrent_samples_per_replica=8",  # two replicas on b share its prompts
]


# ---- helpers ---------------------------------------------------------------------------------


def _serve_cli(cluster: NetnsCluster, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    """Ray's own `serve` CLI against the head's dashboard (REST), from this namespace."""
    cmd = [str(Path(sys.executable).parent / "serve"), *args, "--address", cluster.dashboard_url]
    return subprocess.run(cmd, cwd=ROOT, env=cluster.node_env(), capture_output=True, text=True, timeout=timeout)


def _titles(cluster: NetnsCluster) -> dict[str, list[str]]:
    """Per node, the Ray process titles of the meshrl replicas and trainer ranks in its namespace."""
    out: dict[str, list[str]] = {}
    for name, node in cluster.nodes.items():
        titles = []
        for pid in namespace_pids(node.netns):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith("ray::ServeReplica:") or cmd.startswith("ray::TrainWorker"):
                titles.append(cmd.split()[0])
        out[name] = sorted(titles)
    return out


def _count(titles: list[str], prefix: str) -> int:
    return sum(t.startswith(prefix) for t in titles)


class Watch:
    """Coordinator and trainer status through Serve's gRPC ingress on the head (node a)."""

    def __init__(self, cluster: NetnsCluster) -> None:
        self.address = f"{cluster.ip('a')}:{GRPC_PORT}"
        self.cluster = cluster
        self.status: Any = None
        self.trainer: Any = None

    async def _poll(self) -> None:
        async with CoordinatorClient(self.address, application="coordinator", timeout_s=10) as coord:
            self.status = await coord.status()
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            try:
                self.trainer = await stub.GetTrainerStatus(
                    trainer_pb2.GetTrainerStatusRequest(), metadata=(("application", "trainer"),), timeout=10)
            except grpc.RpcError:
                self.trainer = None  # the trainer's node is down, or its replica is starting

    def until(self, what: str, ok: Callable[[Watch], bool], timeout_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                asyncio.run(self._poll())
            except grpc.RpcError:
                time.sleep(2.0)  # the apps are still deploying
                continue
            if ok(self):
                return
            time.sleep(2.0)
        tails = "\n".join(f"--- node {n}:\n{self.cluster.tail(n, 15)}" for n in self.cluster.nodes)
        raise AssertionError(f"not within {timeout_s:.0f}s: {what}\ncoordinator: {self.status}\n"
                             f"trainer: {self.trainer}\nprocesses: {_titles(self.cluster)}\n{tails}")

    def catch(self, what: str, ok: Callable[[Watch], bool], timeout_s: float = WAIT_S) -> None:
        """Like `until`, for a moment rather than a state: the coordinator alone, polled every 0.1 s on
        one channel. Leases are in flight only while a replica generates; on a fast machine the
        replicas spend most of a step waiting on the staleness gate, so a 2 s poll can miss every one."""

        async def poll() -> bool:
            deadline = time.monotonic() + timeout_s
            async with CoordinatorClient(self.address, application="coordinator", timeout_s=10) as coord:
                while time.monotonic() < deadline:
                    try:
                        self.status = await coord.status()
                    except grpc.RpcError:
                        await asyncio.sleep(1.0)
                        continue
                    if ok(self):
                        return True
                    await asyncio.sleep(0.1)
            return False

        if not asyncio.run(poll()):
            tails = "\n".join(f"--- node {n}:\n{self.cluster.tail(n, 15)}" for n in self.cluster.nodes)
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}\ncoordinator: {self.status}\n"
                                 f"processes: {_titles(self.cluster)}\n{tails}")

    @property
    def totals(self) -> Any:
        return self.status.totals


def _events(run_dir: Path, service: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted((run_dir / "logs").glob(f"{service}.*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append({**json.loads(line), "_file": path.name})
            except ValueError:
                continue
    return out


def _audit(cluster: NetnsCluster) -> dict[str, Any]:
    """CoordinatorDeployment.audit through a handle, from a one-off driver on node a."""
    code = ("import json, ray\nfrom ray import serve\n"
            "ray.init(logging_level='ERROR', log_to_driver=False)\n"
            "print('AUDIT' + json.dumps(serve.get_app_handle('coordinator').audit.remote().result(timeout_s=120)))\n")
    out = cluster.python_in("a", code)
    lines = [x for x in out.stdout.splitlines() if x.startswith("AUDIT")]
    assert lines, f"audit failed:\n{out.stdout}\n{out.stderr[-3000:]}"
    return json.loads(lines[-1][len("AUDIT"):])  # type: ignore[no-any-return]


# ---- the test ----------------------------------------------------------------------------------


@pytest.mark.timeout(2400)
def test_serve_deploy_across_nodes_survives_losing_the_rollout_and_trainer_nodes(
    cluster: NetnsCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"  # every node's processes see this path (one filesystem)
    gen = subprocess.run([sys.executable, "-m", "meshrl.cli", "serve-config", "--run-dir", str(run_dir), *PLACEMENT, *RUN],
                         cwd=ROOT, env=cluster.node_env(), capture_output=True, text=True, timeout=600)
    assert gen.returncode == 0, gen.stderr
    serve_yaml = tmp_path / "serve.yaml"
    serve_yaml.write_text(gen.stdout)
    doc = yaml.safe_load(gen.stdout)
    options = {a["name"]: a["deployments"][0]["ray_actor_options"] for a in doc["applications"]}
    assert options["rollout"]["resources"] == {"node_b": 1} and options["trainer"]["resources"] == {"node_c": 1}
    assert not re.search(r"node:(<|\d)", gen.stdout)  # no node:<ip> resource anywhere

    deployed = _serve_cli(cluster, "deploy", str(serve_yaml))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    w = Watch(cluster)
    try:
        # -- placement and the data plane across nodes ------------------------------------------------
        w.until("the trainer trained a step on weights the rollouts loaded",
                lambda w: w.trainer is not None and w.trainer.step >= 1 and w.status.policy_version >= 1)
        titles = _titles(cluster)
        assert _count(titles["a"], "ray::ServeReplica:coordinator:") == 1, titles
        assert _count(titles["a"], "ray::ServeReplica:param_server:") == 1, titles
        assert _count(titles["b"], "ray::ServeReplica:rollout:") == 2, titles
        assert _count(titles["c"], "ray::ServeReplica:trainer:") == 1, titles
        assert _count(titles["c"], "ray::TrainWorker") == 1, titles
        plane = f"{cluster.ip('a')}:{PS_PORT}"
        listening = [e["address"] for e in _events(run_dir, "param_server") if e["event"] == "param_server_listening"]
        assert listening == [plane], listening
        for service in ("trainer", "rollout"):
            found = {e["address"] for e in _events(run_dir, service) if e["event"] == "param_server_discovered"}
            assert found == {plane}, (service, found)

        # -- lose node b (both rollout replicas) with leases in flight ---------------------------------
        w.catch("rollouts hold leases after a checkpoint",
                lambda w: w.totals.in_flight > 0 and w.status.last_checkpoint_step >= SAVE_FREQ)
        expired_before, consumed_before = w.totals.leases_expired, w.totals.consumed
        def submitted(w: Watch) -> int:  # groups that reached the coordinator: queued or consumed
            return int(w.totals.queued + w.totals.consumed)

        submitted_before = submitted(w)
        cluster.kill_node("b")
        cluster.wait_for_nodes(2, without=["b"])
        # The leases in flight at the kill either expire (the replicas died holding them) or were
        # submitted in the moment the kill took to land (tiny model, fast groups); either way none
        # may stay in flight, and the audit at the end shows nothing lost or trained twice.
        w.until("the dead replicas' leases expired and went back to retry, or were submitted before the kill landed",
                lambda w: w.totals.in_flight == 0
                and (w.totals.leases_expired > expired_before or submitted(w) > submitted_before),
                timeout_s=LEASE_TIMEOUT_S + 120)
        print(f"node b lost: leases expired {w.totals.leases_expired - expired_before}, "
              f"groups submitted meanwhile {submitted(w) - submitted_before}", flush=True)
        assert not any(_count(t, "ray::ServeReplica:rollout:") for t in _titles(cluster).values())  # it waits
        cluster.start_node("b")
        cluster.wait_for_nodes(3)
        w.until("the rollout replicas came back on node b and the run went on",
                lambda w: _count(_titles(cluster)["b"], "ray::ServeReplica:rollout:") == 2
                and w.totals.consumed > consumed_before + MINI_BATCH)

        # -- lose node c (the trainer) with a step past its checkpoint delivered -----------------------
        w.until("a checkpoint, and a step delivered past it",
                lambda w: w.trainer is not None and w.status.last_checkpoint_step >= 2 * SAVE_FREQ
                and w.status.trainer_step > w.status.last_checkpoint_step and w.status.trainer_step < STEPS)
        checkpoint = w.status.last_checkpoint_step
        cluster.kill_node("c")
        cluster.wait_for_nodes(2, without=["c"])
        cluster.start_node("c")
        cluster.wait_for_nodes(3)

        # -- the run finishes ---------------------------------------------------------------------------
        w.until("every prompt trained and the last step checkpointed",
                lambda w: w.trainer is not None and w.trainer.step == STEPS and w.trainer.last_checkpoint_step == STEPS
                and w.totals.consumed == PROMPTS)
        audit = _audit(cluster)
        assert audit["balanced"] and audit["issued"] >= PROMPTS and not audit["in_flight"], audit
        assert w.totals.prompts_total == PROMPTS
    finally:
        _serve_cli(cluster, "shutdown", "-y")

    # the trainer restarted on c from the checkpoint and the coordinator re-queued what it had
    # (in time order: the log files come in pid order, and the replacement's pid may be the lower)
    started = sorted((e for e in _events(run_dir, "trainer") if e["event"] == "trainer_started"),
                     key=lambda e: e["timestamp"])
    assert len({e["_file"] for e in started}) == 2, started  # two trainer replicas, one after the other
    resumed = [e for e in _events(run_dir, "trainer") if e["event"] == "trainer_resumed_from_checkpoint"]
    assert len(resumed) == 1 and resumed[0]["step"] >= checkpoint, resumed  # (one may have landed since the poll)
    assert started[-1]["step"] == resumed[0]["step"] and started[-1]["requeued"] > 0, started[-1]
    # metrics: every step, the ones trained twice (after the checkpoint, before c died) included
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert set(steps) == set(range(1, STEPS + 1)), steps
    report = subprocess.run([sys.executable, "-m", "meshrl.cli", "report", str(run_dir)], cwd=ROOT,
                            env=cluster.node_env(), capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    page = (run_dir / "report.html").read_text()  # self-contained: the plots are embedded
    assert "data:image/png;base64," in page and "reward" in page, list(run_dir.iterdir())
