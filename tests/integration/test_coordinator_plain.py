"""The same servicer as a plain grpc.aio server (no Ray): message-size limits, restart from the
ledger over the wire, and `meshrl coordinator serve` as a real process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshrl.v1 import common_pb2, coordinator_pb2
from services.common.config import load_config
from services.coordinator.client import CoordinatorClient
from services.coordinator.server import CoordinatorServer

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["coordinator.port=0", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "rollout.total_rollout_steps=10",
             "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1.0",
             "actor_rollout_ref.rollout.n=2"]


def _group(lease, n: int = 2, tokens: int = 2) -> common_pb2.TrajectoryGroup:
    g = common_pb2.TrajectoryGroup(lease_id=lease.lease_id, prompt=lease.prompt, prompt_token_ids=[1, 2])
    for i in range(n):
        g.responses.add(sample_index=i, token_ids=[3] * tokens, logprobs=[-0.5] * tokens, versions=[0] * tokens)
    return g


def _refused_submit(cfg, run_dir: Path, bad: Callable[[Any], common_pb2.TrajectoryGroup]) -> grpc.aio.AioRpcError:
    """Lease one prompt and submit `bad(lease)`, which must be refused; then nothing was lost: the
    lease is still in flight and a normal submit of it lands. Returns the refusal."""

    async def main() -> grpc.aio.AioRpcError:
        server = CoordinatorServer(cfg, run_dir)
        await server.start()
        try:
            async with CoordinatorClient(server.address) as c:
                (lease,) = (await c.lease("r", 1)).leases
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.submit("r", [bad(lease)])
                assert (await c.status()).totals.in_flight == 1
                assert list((await c.submit("r", [_group(lease)])).statuses) == [1]
                return e.value
        finally:
            await server.stop()

    return asyncio.run(main())


def test_oversized_message_is_resource_exhausted(tmp_path: Path) -> None:
    cfg = load_config(None, [*OVERRIDES, "coordinator.max_message_mb=1"])
    refused = _refused_submit(cfg, tmp_path, lambda lease: _group(lease, tokens=200_000))
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_fetch_batch_train_version_over_grpc(tmp_path: Path) -> None:
    """FetchBatch.train_version: staleness against the version named, refused at once (no wait)
    outside current..current+1, with nothing taken."""
    cfg = load_config(None, OVERRIDES)

    async def main() -> None:
        server = CoordinatorServer(cfg, tmp_path)
        await server.start()
        try:
            async with CoordinatorClient(server.address) as c:
                grant = await c.lease("r", 2)
                await c.submit("r", [_group(lease) for lease in grant.leases])
                t = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.fetch_batch("t", 1, 3, timeout_ms=5000, train_version=2)
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "train_version 2" in e.value.details()
                assert time.monotonic() - t < 2.0 and (await c.status()).totals.queued == 2
                batch = await c.fetch_batch("t", 1, 2, timeout_ms=1000, train_version=1)
                assert list(batch.staleness) == [1, 1] and batch.policy_version == 0
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_version_committed_after_stop_is_marked_as_reaching_no_rollout(tmp_path: Path) -> None:
    """CommitVersion says `stopping` exactly when the rollouts have already been told to leave
    WatchVersions: a collective sender then skips a broadcast no one would join. The last watch
    message carries the versions committed before the stop."""
    cfg = load_config(None, OVERRIDES)

    async def main() -> None:
        server = CoordinatorServer(cfg, tmp_path)
        await server.start()
        try:
            async with CoordinatorClient(server.address) as c:
                before = await c.commit_version("t0", common_pb2.WeightsRef(policy_version=1))
                await c.stop()
                after = await c.commit_version("t0", common_pb2.WeightsRef(policy_version=2))
                seen = [m async for m in c.watch_versions("r0")]  # a watcher (re)connecting now
        finally:
            await server.stop()
        assert (before.policy_version, before.stopping) == (1, False)
        assert (after.policy_version, after.stopping) == (2, True)
        assert [(m.weights.policy_version, m.stopping) for m in seen] == [(1, True)]

    asyncio.run(main())


def test_restart_on_same_ledger_over_grpc(tmp_path: Path) -> None:
    cfg = load_config(None, OVERRIDES)

    async def phase1() -> tuple[str, list[str]]:
        server = CoordinatorServer(cfg, tmp_path)
        await server.start()
        async with CoordinatorClient(server.address) as c:
            grant = await c.lease("r", 4)
            await c.submit("r", [_group(grant.leases[0])])
            run_id = (await c.status()).run_id
        await server.stop()
        return run_id, [lease.lease_id for lease in grant.leases]

    async def phase2(run_id: str, lease_ids: list[str]) -> None:
        server = CoordinatorServer(cfg, tmp_path)
        await server.start()
        async with CoordinatorClient(server.address) as c:
            st = await c.status()
            assert st.run_id == run_id and st.totals.in_flight == 3 and st.totals.queued == 1
            batch = await c.fetch_batch("t", 1, 1, timeout_ms=1000)
            assert batch.groups[0].lease_id == lease_ids[0]
        await server.stop()

    asyncio.run(phase2(*asyncio.run(phase1())))


def test_coordinator_serve_cli_process(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MESHRL_TOKEN": "tok"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrl.cli", "coordinator", "serve", *OVERRIDES[1:], f"coordinator.port={port}",
         "--run-dir", str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            out = subprocess.run([sys.executable, "-m", "meshrl.cli", "status", "--address", f"127.0.0.1:{port}", "--json",
                                  "--timeout", "2"], capture_output=True, text=True, env=env)
            if out.returncode == 0:
                status = out.stdout
                break
            time.sleep(0.5)
        assert status is not None, "coordinator did not come up"
        assert (tmp_path / "config.resolved.yaml").exists() and (tmp_path / "ledger.sqlite").exists()
        stop = subprocess.run([sys.executable, "-m", "meshrl.cli", "stop", "--address", f"127.0.0.1:{port}"],
                              capture_output=True, text=True, env=env)
        assert stop.returncode == 0, stop.stderr  # MESHRL_TOKEN from the environment
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_tls_and_token_on_the_plain_server(tmp_path: Path, tls_cert: tuple[Path, Path]) -> None:
    cert, key = tls_cert
    cfg = load_config(None, [*OVERRIDES, "coordinator.host=localhost", f"coordinator.tls_cert_file={cert}",
                             f"coordinator.tls_key_file={key}", "coordinator.token=t0k"])

    async def main() -> None:
        server = CoordinatorServer(cfg, tmp_path)
        await server.start()
        try:
            async with CoordinatorClient(server.address, ca_file=str(cert), token="t0k") as c:
                await c.pause()  # TLS + token
                assert (await c.status()).paused
            async with CoordinatorClient(server.address, timeout_s=3) as plain:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await plain.status()  # plaintext to a TLS port: refused
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop()

    asyncio.run(main())


def test_fetch_batch_larger_than_the_message_limit_loses_nothing(tmp_path: Path) -> None:
    """Groups whose sum passes the 1 MiB limit come in several replies, in order; before, the
    reply failed RESOURCE_EXHAUSTED after its groups had left the queue. A client with a smaller
    receive limit gets smaller replies; a group larger than any reply is refused untouched."""
    cfg = load_config(None, [*OVERRIDES, "coordinator.max_message_mb=1", "rollout.total_rollout_steps=4",
                             "async_training.staleness_threshold=3.0"])

    async def main() -> None:
        server = CoordinatorServer(cfg, tmp_path)
        await server.start()
        try:
            async with CoordinatorClient(server.address, max_message_bytes=1 << 20) as c:
                grant = await c.lease("r", 4)
                assert len(grant.leases) == 4
                for lease in grant.leases:  # ~300 KB each: 3 fit a 1 MiB reply, not 4
                    await c.submit("r", [_group(lease, tokens=25_000)])
                first = await c.fetch_batch("t", 1, 4, timeout_ms=100)
                assert len(first.groups) == 3
                rest = await c.fetch_batch("t", 1, 1, timeout_ms=100)
                order = [g.prompt.prompt_seq for g in [*first.groups, *rest.groups]]
                assert order == [lease.prompt.prompt_seq for lease in grant.leases]
                assert (await c.status()).totals.consumed == 4
        finally:
            await server.stop()

    asyncio.run(main())


def test_small_client_limit_gets_smaller_replies_and_oversize_is_refused(tmp_path: Path) -> None:
    cfg = load_config(None, [*OVERRIDES, "rollout.total_rollout_steps=4", "async_training.staleness_threshold=3.0"])

    async def main() -> None:
        server = CoordinatorServer(cfg, tmp_path)
        await server.start()
        try:
            async with CoordinatorClient(server.address) as c:
                grant = await c.lease("r", 4)
                await c.submit("r", [_group(grant.leases[0], tokens=60_000)])  # ~720 KB
                await c.submit("r", [_group(lease, tokens=10_000) for lease in grant.leases[1:]])  # ~120 KB each
            async with CoordinatorClient(server.address, max_message_bytes=400_000) as small:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await small.fetch_batch("t", 1, 4, timeout_ms=100)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_message_mb" in e.value.details()
                assert (await small.status()).totals.queued == 4  # untouched
            async with CoordinatorClient(server.address) as c:
                assert len((await c.fetch_batch("t", 1, 1, timeout_ms=100)).groups) == 1
            async with CoordinatorClient(server.address, max_message_bytes=300_000) as small:
                got = []
                for _ in range(3):
                    got += list((await small.fetch_batch("t", 1, 3, timeout_ms=100)).groups)
                assert len(got) == 3
                assert (await small.status()).totals.consumed == 4
        finally:
            await server.stop()

    asyncio.run(main())


def test_lease_reply_is_sized_to_a_small_client_limit(tmp_path: Path) -> None:
    cfg = load_config(None, [*OVERRIDES, "rollout.total_rollout_steps=40", "async_training.staleness_threshold=20.0"])

    async def main() -> None:
        server = CoordinatorServer(cfg, tmp_path)
        await server.start()
        try:
            async with CoordinatorClient(server.address, max_message_bytes=1500) as small:
                grant = await small.lease("r", 40)
                assert 0 < len(grant.leases) < 40 and grant.limit == coordinator_pb2.LEASE_LIMIT_MESSAGE_SIZE
                assert grant.ByteSize() <= 1500
                st = await small.status()
                assert st.totals.in_flight == len(grant.leases)
        finally:
            await server.stop()

    asyncio.run(main())


def test_submitted_groups_are_checked_against_the_configured_string_limits(tmp_path: Path) -> None:
    """A group's bytes reach the servicer unparsed, so the servicer checks their strings itself,
    against `security.limits` of this server's config (not the process defaults)."""
    cfg = load_config(None, [*OVERRIDES, "security.limits.max_name_chars=32"])

    def bad(lease: Any) -> common_pb2.TrajectoryGroup:
        g = _group(lease)
        g.prompt.data_source = "x" * 100  # under the default 1024, over the configured 32
        return g

    refused = _refused_submit(cfg, tmp_path, bad)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "groups[0].prompt.data_source" in refused.details()
    assert "security.limits.max_name_chars" in refused.details()
