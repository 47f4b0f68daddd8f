"""The coordinator in real Ray Serve, called over gRPC through Serve's ingress; the CLI against it;
bad input, unknown leases and a wrong token get the right status codes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from meshrl.v1 import common_pb2
from services.common.config import load_config
from services.coordinator.client import CoordinatorClient

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret"


def _group(lease, version: int = 0, n: int = 2) -> common_pb2.TrajectoryGroup:
    g = common_pb2.TrajectoryGroup(lease_id=lease.lease_id, prompt=lease.prompt, prompt_token_ids=[1, 2, 3],
                                   min_policy_version=version, max_policy_version=version)
    for i in range(n):
        g.responses.add(sample_index=i, token_ids=[4, 5, 6], logprobs=[-0.1, -0.2, -0.3], versions=[version] * 3,
                        reward=1.0)
    return g


@pytest.fixture(scope="module")
def coordinator_app(serve_grpc_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    from services.coordinator.deployment import build_app

    cfg = load_config(None, [
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "async_training.staleness_threshold=0.5",
        "async_training.trigger_parameter_sync_step=1", "rollout.total_rollout_steps=40", "actor_rollout_ref.rollout.n=2",
        f"coordinator.token={TOKEN}", "coordinator.max_groups_per_call=8", "async_training.concurrent_samples_per_replica=8",
    ])
    run_dir = tmp_path_factory.mktemp("coord")
    serve.run(build_app({"config": cfg.model_dump(mode="json"), "run_dir": str(run_dir)}), name="coordinator",
              route_prefix="/coordinator")
    yield f"127.0.0.1:{serve_grpc_port}"
    serve.delete("coordinator")


def run(coro):
    return asyncio.run(coro)


def test_lease_submit_fetch_commit_through_serve(coordinator_app: str) -> None:
    async def main() -> None:
        async with CoordinatorClient(coordinator_app, token=TOKEN, application="coordinator") as c:
            assert await c.echo(b"ping") == b"ping"
            grant = await c.lease("r0", 8)
            assert len(grant.leases) == 6  # int(4 * 1.5 * 1)
            assert grant.sampling.n == 2
            resp = await c.submit("r0", [_group(lease) for lease in grant.leases[:4]])
            assert list(resp.statuses) == [1, 1, 1, 1]
            again = await c.submit("r0", [_group(grant.leases[0])])
            assert list(again.statuses) == [2]  # DUPLICATE
            batch = await c.fetch_batch("t0", 1, 4, timeout_ms=5000)
            assert [g.lease_id for g in batch.groups] == [lease.lease_id for lease in grant.leases[:4]]
            assert list(batch.staleness) == [0, 0, 0, 0]
            committed = await c.commit_version("t0", common_pb2.WeightsRef(policy_version=1))
            assert committed.policy_version == 1 and committed.budget_used == 2
            watch = c.watch_versions("r0")
            first = await asyncio.wait_for(watch.__anext__(), 10)
            assert first.weights.policy_version == 1
            status = await c.status()
            assert status.totals.consumed == 4 and status.totals.in_flight == 2 and status.policy_version == 1
            await watch.aclose()

    run(main())


def test_fetch_waits_for_a_submission(coordinator_app: str) -> None:
    async def main() -> None:
        async with CoordinatorClient(coordinator_app, token=TOKEN, application="coordinator") as c:
            pending = asyncio.create_task(c.fetch_batch("t0", 2, 1, timeout_ms=20_000))
            await asyncio.sleep(0.3)
            assert not pending.done()
            grant = await c.lease("r1", 1)
            assert grant.leases, "budget should allow one lease"
            await c.submit("r1", [_group(grant.leases[0], version=1)])
            batch = await asyncio.wait_for(pending, 20)
            assert [g.lease_id for g in batch.groups] == [grant.leases[0].lease_id]

    run(main())


def test_bad_requests_get_the_right_codes(coordinator_app: str) -> None:
    async def main() -> None:
        async with CoordinatorClient(coordinator_app, token=TOKEN, application="coordinator") as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.lease("", 1)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "replica_id" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.lease("r", 100_000)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_groups" in e.value.details()
            fake = common_pb2.TrajectoryGroup(lease_id="no-such-lease", prompt_token_ids=[1], min_policy_version=0,
                                              max_policy_version=0)
            fake.prompt.prompt_seq = 0
            fake.responses.add(token_ids=[1], logprobs=[-1.0], versions=[0])
            fake.responses.add(token_ids=[1], logprobs=[-1.0], versions=[0])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.submit("r", [fake])
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "groups[0].lease_id" in e.value.details()
            fake.responses[1].ClearField("logprobs")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.submit("r", [fake])
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "groups[0].responses[1].logprobs" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.submit("r", [fake] * 9)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "groups" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.commit_version("t0", common_pb2.WeightsRef(policy_version=99))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        async with CoordinatorClient(coordinator_app, token="wrong", application="coordinator") as bad:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await bad.pause()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with CoordinatorClient(coordinator_app, application="coordinator") as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await anonymous.stop()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await anonymous.status()  # status is the operator's too (the token is the operator's)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    run(main())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "meshrl.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_cli_against_serve(coordinator_app: str) -> None:
    common = ["--address", coordinator_app, "--application", "coordinator"]
    assert _cli("status", *common, "--json").returncode == 3  # no token
    common += ["--token", TOKEN]
    out = _cli("status", *common, "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["max_required_samples"] == "6"  # uint64 renders as a string in proto JSON
    denied = _cli("pause", *common[:-2], "--token", "nope")
    assert denied.returncode == 3 and "UNAUTHENTICATED" in denied.stderr
    assert _cli("pause", *common).returncode == 0
    assert json.loads(_cli("status", *common, "--json").stdout)["paused"] is True
    assert _cli("resume", *common).returncode == 0
    out = _cli("set-staleness", "1.0", *common)
    assert out.returncode == 0 and "max_required_samples=8" in out.stdout
    assert _cli("checkpoint", *common).returncode == 0
    assert json.loads(_cli("status", *common, "--json").stdout)["checkpoint_requested"] is True
    table = _cli("status", *common)
    assert table.returncode == 0 and "staleness_threshold" in table.stdout
