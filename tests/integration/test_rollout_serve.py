"""The rollout deployment on real Ray Serve with the real coordinator (grpc.aio on loopback): the
replica leases and generates on its own, answers RolloutService through Serve's gRPC ingress, is
healthy, and on shutdown returns its leases so nothing waits for lease expiry."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.config import load_config
from services.coordinator.client import CoordinatorClient
from services.coordinator.server import CoordinatorServer
from tests.rollout_helpers import LoopThread, length_scorer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def ray_serve(serve_grpc_port: int) -> Iterator[int]:
    """The session's Ray + Serve (tests/integration/conftest.py); the rollout app is removed after."""
    from ray import serve

    yield serve_grpc_port
    for app in ("rollout",):
        try:
            serve.delete(app)
        except Exception:
            pass


def _poll(cond: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_rollout_deployment_leases_serves_grpc_and_drains(tmp_path: Path, ray_serve: int) -> None:
    from ray import serve

    from services.rollout.deployment import build_app

    loop = LoopThread()
    cfg = load_config(None, [
        "coordinator.port=0",
        "coordinator.lease_timeout_s=600",
        # A budget the test never uses up: the replica leases the whole time, so groups are still
        # generating when it is deleted (with 8 groups at version 0, a fast host had generated and
        # submitted them all before the drain, and there was nothing left to return).
        "async_training.staleness_threshold=50",
        "rollout.total_rollout_steps=40",
        "data.synthetic.num_train=64",
        "data.max_response_length=160",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "async_training.concurrent_samples_per_replica=2",
        "rollout_worker.device=cpu",
        "rollout_worker.idle_poll_s=0.05",
        "serve.rollout.num_cpus=0.5",
    ])
    async def start() -> tuple[CoordinatorServer, CoordinatorClient]:
        # grpc.aio objects belong to the loop they are made on: make them on the loop thread.
        srv = CoordinatorServer(cfg, tmp_path / "run")
        await srv.start()
        return srv, CoordinatorClient(srv.address)

    server, client = loop.run(start())
    cfg.rollout_worker.coordinator_address = server.address
    channel = grpc.insecure_channel(f"127.0.0.1:{ray_serve}")
    try:
        serve.run(build_app(cfg, scorer=length_scorer), name="rollout", route_prefix="/rollout")
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        md = (("application", "rollout"),)
        # The replica's own loop: groups get submitted to the coordinator.
        _poll(lambda: loop.run(client.status()).totals.queued >= 2, 180, "submitted groups")
        st = stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), metadata=md, timeout=30)
        assert st.engine == "transformers" and st.replica_id.startswith("rollout-")
        assert st.groups_submitted >= 2
        # Validation through Serve's gRPC ingress.
        prompt = common_pb2.Prompt(prompt_id="val:0", text="7+8=", ground_truth="15")
        resp = stub.Generate(rollout_pb2.GenerateRequest(request_id="v1", prompt=prompt, score=True), metadata=md, timeout=120)
        assert resp.group.responses and all(len(r.token_ids) == len(r.logprobs) for r in resp.group.responses)
        bad = rollout_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(n=1, max_tokens=4, temperature=-1))
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(bad, metadata=md, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.temperature" in (err.value.details() or "")
        # Shutdown drains: in-flight leases go back at once (lease timeout is 10 minutes here).
        _poll(lambda: loop.run(client.status()).totals.in_flight > 0, 60, "leases in flight")
        serve.delete("rollout")
        status = _poll(
            lambda: (s := loop.run(client.status())) and s.totals.in_flight == 0 and s.totals.leases_returned > 0 and s,
            60, "leases returned on shutdown",
        )
        assert status.totals.leases_expired == 0
    finally:
        channel.close()
        loop.run(client.close())
        loop.run(server.stop())
        server = client = None  # type: ignore[assignment]  # grpc.aio objects must die while their loop runs
        gc.collect()
        loop.close()
