"""External reward services over real gRPC on loopback (no Ray): the example server as a
subprocess, outages and recovery, garbage replies, tokens and TLS."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from meshrl.v1 import reward_pb2 as pb
from meshrl.v1 import reward_pb2_grpc
from services.common.config import MeshConfig, load_config
from services.common.errors import InvalidArgument, MeshError, Unauthenticated, Unavailable
from services.common.serve_util import free_port
from services.reward.client import RewardClient
from services.reward.local import LocalScorer
from services.reward.server import RewardServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reward_server" / "server.py"
_spec = importlib.util.spec_from_file_location("example_reward_server", EXAMPLE)
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def endpoint_cfg(address: str, *extra: str, data_sources: str = "[openai/gsm8k]") -> MeshConfig:
    ep = f"{{address: '{address}', name: judge, data_sources: {data_sources}, max_retries: 2, backoff_initial_s: 0.05, backoff_max_s: 0.2, breaker_open_s: 0.1, breaker_max_open_s: 0.4, timeout_s: 5"
    ep += "".join(f", {e}" for e in extra) + "}"
    return load_config(None, [f"reward.endpoints=[{ep}]"])


def gsm8k_items(n: int) -> tuple[list[pb.ScoreItem], list[float]]:
    items, expected = [], []
    for i in range(n):
        right = i % 3 != 0
        items.append(
            pb.ScoreItem(
                item_id=f"q{i}", data_source="openai/gsm8k", ground_truth=str(100 + i),
                response_text=f"thinking ... #### {100 + i if right else 7}", response_token_ids=[1, 2, 3],
            )
        )
        expected.append(1.0 if right else 0.0)
    return items, expected


async def poll(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.02)


async def start_example_subprocess(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLE), "--port", "0", *args, stdout=asyncio.subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    assert "listening on" in line, line
    return proc, line.strip().rsplit(" ", 1)[-1]


async def stop_subprocess(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)


def test_happy_path_through_the_reward_service_and_the_example_server() -> None:
    """rollout -> RewardClient -> reward service (plain gRPC) -> example server (subprocess)."""

    async def go() -> None:
        proc, address = await start_example_subprocess()
        try:
            cfg = endpoint_cfg(address)
            server = RewardServer(cfg)
            await server.start()
            items, expected = gsm8k_items(10)
            items.append(pb.ScoreItem(item_id="local", data_source="meshrl/addition", response_text="5</s>", ground_truth="5"))
            async with RewardClient(server.address, timeout_s=30) as client:
                results = await client(items)
            assert [r.item_id for r in results] == [it.item_id for it in items]
            assert [r.score for r in results] == [*expected, 1.0]
            assert results[1].metrics["acc"] == 1.0 and results[1].metrics["format"] == 1.0  # from the example server
            st = server.pipeline.status()["endpoints"][0]
            assert st["state"] == "closed" and st["items_scored"] == 10 and st["retries"] == 0
            await server.stop()
        finally:
            await stop_subprocess(proc)

    asyncio.run(go())


def test_service_down_then_up_retries_and_loses_nothing() -> None:
    async def go() -> None:
        port = free_port()
        scorer = LocalScorer(endpoint_cfg(f"127.0.0.1:{port}", "batch_size: 4"))
        items, expected = gsm8k_items(10)
        task = asyncio.ensure_future(scorer(items))
        # The endpoint is down: retries run out, the breaker opens, all 10 items wait (visibly).
        ep = lambda: scorer.status()["endpoints"][0]  # noqa: E731
        await poll(lambda: ep()["state"] != "closed" and ep()["waiting_items"] == 10)
        assert not task.done()
        assert ep()["retries"] >= 2 and "UNAVAILABLE" in (ep()["last_error"] or "")
        server, _ = await example.start_server("127.0.0.1", port)
        try:
            results = await asyncio.wait_for(task, 60)
            assert [r.item_id for r in results] == [it.item_id for it in items]
            assert [r.score for r in results] == expected
            assert ep()["state"] == "closed" and ep()["waiting_items"] == 0 and ep()["items_scored"] == 10
        finally:
            await scorer.close()
            await server.stop(None)

    asyncio.run(go())


def test_max_wait_gives_up_with_unavailable_never_a_zero_score() -> None:
    async def go() -> None:
        scorer = LocalScorer(endpoint_cfg(f"127.0.0.1:{free_port()}", "max_wait_s: 0.5"))
        items, _ = gsm8k_items(3)
        with pytest.raises(Unavailable, match=r"reward endpoint 'judge' .*max_wait_s=0.5"):
            await asyncio.wait_for(scorer(items), 60)
        await scorer.close()

    asyncio.run(go())


GarbageHandler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


async def start_raw_server(handler: GarbageHandler) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    method = grpc.unary_unary_rpc_method_handler(handler, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("meshrl.v1.RewardService", {"Score": method})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def not_a_proto(request: bytes, context: Any) -> bytes:
    return b"\xff\xff\xff this is not a ScoreResponse"


async def too_few(request: bytes, context: Any) -> bytes:
    req = pb.ScoreRequest.FromString(request)
    return pb.ScoreResponse(results=[pb.ScoreResult(item_id=req.items[0].item_id, score=1.0)]).SerializeToString()


async def rejects(request: bytes, context: Any) -> bytes:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "items[0].ground_truth: must be a number")
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("handler", "reason", "code"),
    [  # garbage is the endpoint's fault (INTERNAL); a refusal is the items' (INVALID_ARGUMENT)
        (not_a_proto, "not a meshrl.v1.ScoreResponse", grpc.StatusCode.INTERNAL),
        (too_few, "returned 1 results for 3 items", grpc.StatusCode.INTERNAL),
        (rejects, "rejected the items: items[0].ground_truth: must be a number", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_garbage_from_an_endpoint_or_its_refusal_names_it(handler: GarbageHandler, reason: str, code: grpc.StatusCode) -> None:
    async def go() -> None:
        bad, address = await start_raw_server(handler)
        server = RewardServer(endpoint_cfg(address))
        await server.start()
        items, _ = gsm8k_items(3)
        # The raw status code a gRPC caller sees ...
        channel = grpc.aio.insecure_channel(server.address)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reward_pb2_grpc.RewardServiceStub(channel).Score(pb.ScoreRequest(items=items), timeout=30)
        assert err.value.code() is code
        assert f"reward endpoint 'judge' ({address}, reward.endpoints[0])" in (err.value.details() or "")
        assert reason in (err.value.details() or "")
        await channel.close()
        # ... and what the Python client raises (a rollout replica stops on InvalidArgument only).
        async with RewardClient(server.address) as client:
            with pytest.raises(MeshError) as ierr:
                await client(items)
        assert isinstance(ierr.value, InvalidArgument) == (code is grpc.StatusCode.INVALID_ARGUMENT)
        assert "reward endpoint 'judge'" in str(ierr.value) and reason in str(ierr.value)
        st = server.pipeline.status()["endpoints"][0]
        assert st["retries"] == 0 and st["state"] == "closed"  # garbage is not retried
        await server.stop()
        await bad.stop(None)

    asyncio.run(go())


def test_token_is_sent_and_a_wrong_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        server, port = await example.start_server("127.0.0.1", 0, token="s3cret")
        monkeypatch.setenv("JUDGE_TOKEN", "s3cret")
        items, expected = gsm8k_items(4)
        good = LocalScorer(endpoint_cfg(f"127.0.0.1:{port}", "token_env: JUDGE_TOKEN"))
        assert [r.score for r in await good(items)] == expected
        bad = LocalScorer(endpoint_cfg(f"127.0.0.1:{port}", "token: wrong"))
        with pytest.raises(Unauthenticated, match=r"reward endpoint 'judge'.*token"):
            await bad(items)
        await good.close()
        await bad.close()
        await server.stop(None)

    asyncio.run(go())


def test_tls_with_a_private_ca(tls_cert: tuple[Path, Path]) -> None:
    cert, key = tls_cert

    async def go() -> None:
        server, port = await example.start_server("127.0.0.1", 0, tls_cert=str(cert), tls_key=str(key))
        items, expected = gsm8k_items(3)
        scorer = LocalScorer(
            endpoint_cfg(f"127.0.0.1:{port}", "tls: true", f"ca_file: '{cert}'", "tls_server_name: localhost")
        )
        assert [r.score for r in await scorer(items)] == expected
        await scorer.close()
        await server.stop(None)

    asyncio.run(go())


def test_reward_client_retries_then_reports_unavailable() -> None:
    async def go() -> None:
        items, _ = gsm8k_items(1)
        async with RewardClient(f"127.0.0.1:{free_port()}", max_retries=2, backoff_s=0.01, timeout_s=5) as client:
            with pytest.raises(Unavailable, match="UNAVAILABLE"):
                await client(items)

    asyncio.run(go())
