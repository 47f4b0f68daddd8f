"""The reward application on real Ray Serve: gRPC ingress, DeploymentHandle, batching, an
external endpoint behind it, errors with the field named."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from meshrl.v1 import reward_pb2 as pb
from meshrl.v1 import reward_pb2_grpc
from services.common.config import load_config
from services.common.errors import InvalidArgument
from services.reward.client import HandleScorer, RewardClient
from tests.integration.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reward_server" / "server.py"


@pytest.fixture(scope="module")
def mesh(serve_grpc_port: int) -> Iterator[dict[str, Any]]:
    from ray import serve

    from services.reward.deployment import APP_NAME, ROUTE_PREFIX, build_app

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    judge_port = free_port()
    judge = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--port", str(judge_port)], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert judge.stdout is not None and "listening" in judge.stdout.readline()
        cfg = load_config(
            None,
            [
                f"reward.endpoints=[{{address: '127.0.0.1:{judge_port}', name: judge, data_sources: [ext/judge]}}]",
                "reward.max_batch_size=16",
                "reward.batch_wait_timeout_s=0.02",
                "data.max_response_length=16",
                "reward_model.overlong_buffer.enable=true",
                "reward_model.overlong_buffer.len=8",
                "reward_model.overlong_buffer.log=true",
                "serve.reward.num_cpus=0.25",
            ],
        )
        handle = serve.run(build_app({"config": cfg.model_dump(mode="json")}), name=APP_NAME, route_prefix=ROUTE_PREFIX)
        address = f"127.0.0.1:{serve_grpc_port}"

        async def ready() -> None:
            async with RewardClient(address, application=APP_NAME) as client:
                await client.wait_ready(120)

        asyncio.run(ready())
        yield {"address": address, "handle": handle}
        serve.delete(APP_NAME)
    finally:
        judge.terminate()
        judge.wait(30)


def items_for(n: int, prefix: str = "i") -> tuple[list[pb.ScoreItem], list[float]]:
    items, expected = [], []
    for k in range(n):
        a, b = k, 2 * k
        right = k % 2 == 0
        answer = str(a + b) if right else str(a + b + 1)
        if k % 3 == 0:
            items.append(pb.ScoreItem(
                item_id=f"{prefix}{k}", data_source="meshrl/addition", prompt_text=f"{a}+{b}=",
                response_text=answer + "</s>", ground_truth=str(a + b), response_token_ids=[1] * 4,
            ))
        elif k % 3 == 1:
            items.append(pb.ScoreItem(
                item_id=f"{prefix}{k}", data_source="openai/gsm8k", response_text=f"#### {answer}",
                ground_truth=str(a + b), response_token_ids=[1] * 4,
            ))
        else:
            items.append(pb.ScoreItem(
                item_id=f"{prefix}{k}", data_source="ext/judge", response_text=f"#### {answer}",
                ground_truth=str(a + b), response_token_ids=[1] * 4,
            ))
        expected.append(1.0 if right else 0.0)
    return items, expected


def test_grpc_ingress_scores_builtins_and_the_endpoint(mesh: dict[str, Any]) -> None:
    async def go() -> None:
        async with RewardClient(mesh["address"], application="reward", timeout_s=60) as client:
            # Several concurrent requests: batched together in the replica, answered separately.
            batches = [items_for(7, prefix=f"r{r}-") for r in range(6)]
            results = await asyncio.gather(*(client(items) for items, _ in batches))
            for (items, expected), res in zip(batches, results, strict=True):
                assert [r.item_id for r in res] == [it.item_id for it in items]
                assert [r.score for r in res] == expected
            # DAPO overlong shaping on top: 12 tokens with cap 16 and buffer 8 -> -0.5.
            long_item = pb.ScoreItem(
                item_id="long", data_source="openai/gsm8k", response_text="#### 3", ground_truth="3",
                response_token_ids=[1] * 12,
            )
            (r,) = await client([long_item])
            assert r.score == 0.5 and r.metrics["overlong_reward"] == -0.5 and r.metrics["score"] == 1.0

    asyncio.run(go())


def test_bad_request_is_invalid_argument_with_the_field(mesh: dict[str, Any]) -> None:
    async def go() -> None:
        items, _ = items_for(2)
        items.append(pb.ScoreItem(item_id="x", data_source="nobody/handles-this", response_text="1", response_token_ids=[1]))
        channel = grpc.aio.insecure_channel(mesh["address"])
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Score(pb.ScoreRequest(items=items), metadata=(("application", "reward"),), timeout=60)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "items[2].data_source" in (err.value.details() or "")
        await channel.close()

    asyncio.run(go())


def test_deployment_handle_path(mesh: dict[str, Any]) -> None:
    handle = mesh["handle"]

    async def go() -> None:
        scorer = HandleScorer(handle)
        items, expected = items_for(9, prefix="h")
        assert [r.score for r in await scorer(items)] == expected
        with pytest.raises(InvalidArgument) as err:
            await scorer([pb.ScoreItem(item_id="", data_source="meshrl/addition")])
        assert err.value.field == "items[0].item_id"

    asyncio.run(go())
    status = handle.status.remote().result(timeout_s=60)
    deadline = time.monotonic() + 30
    while status["items_scored"] < 9 and time.monotonic() < deadline:
        status = handle.status.remote().result(timeout_s=60)
    assert status["items_scored"] >= 9
    assert status["stages"] == ["overlong_buffer"]
    assert status["endpoints"][0]["name"] == "judge" and status["endpoints"][0]["state"] == "closed"
