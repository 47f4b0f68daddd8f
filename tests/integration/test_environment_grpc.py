"""External environments over real gRPC on loopback (no Ray): `meshrl environment serve` in
another process (the built-in calculator tool), idempotent retries over the wire, an endpoint
that is down and comes back, one that stays down, garbage replies, tokens."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from meshrl.v1 import environment_pb2 as pb
from services.common.errors import BadReply, InvalidArgument, NotFound, Unauthenticated, Unavailable
from services.common.serve_util import free_port
from services.environment.base import EnvPrompt, Message, ToolCall
from services.environment.client import RemoteEnvironment
from services.environment.config import EnvironmentConfig, EnvironmentEndpointConfig
from services.environment.factory import tool_environment
from services.environment.server import EnvironmentServer

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "configs" / "examples" / "tool_add_tools.yaml"
EXAMPLE = ROOT / "examples" / "environment_server" / "server.py"
PROMPT = EnvPrompt(prompt_id="train:0", data_source="meshrl/tool_add", messages=(Message("user", "123+456="),),
                   ground_truth="579")
ADD = [ToolCall("call_0_0", "add", '{"a": 123, "b": 456}')]


def endpoint(address: str, **kw: Any) -> EnvironmentEndpointConfig:
    base: dict[str, Any] = dict(address=address, name="calc", max_retries=2, backoff_initial_s=0.05, backoff_max_s=0.2,
                                breaker_open_s=0.1, breaker_max_open_s=0.4, timeout_s=5)
    return EnvironmentEndpointConfig(**{**base, **kw})


async def poll(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.02)


async def start_cli_server(*overrides: str, port: int = 0) -> tuple[asyncio.subprocess.Process, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MESHRL_LOG_LEVEL": "WARNING"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshrl.cli", "environment", "serve",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS}", *overrides, "--port", str(port),
        stdout=asyncio.subprocess.PIPE, env=env,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
    assert "listening on" in line, line
    return proc, line.strip().rsplit(" ", 1)[-1]


async def start_example(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(sys.executable, str(EXAMPLE), "--port", "0", *args,
                                                stdout=asyncio.subprocess.PIPE, env=env)
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    assert "listening on" in line, line
    return proc, line.strip().rsplit(" ", 1)[-1]


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)


def test_happy_path_against_a_server_in_another_process() -> None:
    async def go() -> None:
        proc, address = await start_cli_server()
        env = RemoteEnvironment(endpoint(address))
        try:
            start = await env.start("L0/0", PROMPT)
            assert [t["function"]["name"] for t in start.tools] == ["add"]
            r0 = await env.step("L0/0", 0, '<tool_call>{"name":"add","arguments":{"a":123,"b":456}}</tool_call>', ADD)
            assert r0.messages == (Message("tool", "579"),) and not r0.done and r0.tool_errors == 0
            # At-least-once delivery: the same turn again is answered from the server's record.
            assert await env.step("L0/0", 0, "<resent>", ADD) == r0
            bad = await env.step("L0/0", 1, "", [ToolCall("call_1_0", "add", '{"a": "x", "b": 2}')])
            assert bad.tool_errors == 1 and "a must be an integer" in bad.messages[0].content
            assert (await env.step("L0/0", 2, "579", [])).done
            assert (await env.close("L0/0")).reward == 0.0
            st = env.status()
            assert st["state"] == "closed" and st["retries"] == 0 and st["succeeded"] == 6
        finally:
            await env.aclose()
            await stop(proc)

    asyncio.run(go())


def test_the_example_server_plays_the_calculator_task() -> None:
    """examples/environment_server/server.py (another process, no meshrl code but the stubs):
    tools at Start, the sum for a call, errors answered and counted, idempotent turns, a final
    reward at Close, a token when it requires one."""

    async def go() -> None:
        proc, address = await start_example("--token", "s3cret")
        env = RemoteEnvironment(endpoint(address, token="s3cret"))
        try:
            start = await env.start("E/0", PROMPT)
            assert [t["function"]["name"] for t in start.tools] == ["add"]
            r0 = await env.step("E/0", 0, "call", ADD)
            assert r0.messages == (Message("tool", "579"),) and r0.tool_errors == 0 and not r0.done
            assert await env.step("E/0", 0, "call", ADD) == r0
            bad = await env.step("E/0", 1, "", [ToolCall("c1", "sub", "{}"), ToolCall("c2", "", "{", parse_error="invalid JSON")])
            assert bad.tool_errors == 2 and "unknown tool 'sub'" in bad.messages[0].content
            assert (await env.step("E/0", 2, "579", [])).done
            assert (await env.close("E/0")).reward == 1.0
            assert (await env.close("E/0")).reward == 1.0  # idempotent
            nokey = RemoteEnvironment(endpoint(address, name="nokey"))
            with pytest.raises(Unauthenticated):
                await nokey.start("E/1", PROMPT)
            await nokey.aclose()
        finally:
            await env.aclose()
            await stop(proc)

    asyncio.run(go())


def test_down_then_up_retries_and_completes() -> None:
    async def go() -> None:
        port = free_port()
        env = RemoteEnvironment(endpoint(f"127.0.0.1:{port}", max_wait_s=60))
        task = asyncio.ensure_future(env.start("L1/0", PROMPT))
        # Down: the retries run out, the breaker opens, the call waits (visibly).
        await poll(lambda: env.status()["state"] != "closed" and env.status()["waiting"] == 1)
        assert not task.done() and env.status()["retries"] >= 2 and "UNAVAILABLE" in (env.status()["last_error"] or "")
        proc, _ = await start_cli_server(port=port)
        try:
            start = await asyncio.wait_for(task, 60)
            assert start.tools and env.status()["state"] == "closed" and env.status()["waiting"] == 0
            assert (await env.step("L1/0", 0, "", ADD)).messages[0].content == "579"
        finally:
            await env.aclose()
            await stop(proc)

    asyncio.run(go())


def test_a_restart_between_the_last_step_and_close_answers_not_found_not_an_empty_reward() -> None:
    """The restarted server lost the session: Close is NOT_FOUND (the agent loop fails the group and
    its prompt goes back), never an empty CloseResponse the trajectory would be trained on. The
    example server in another language's place keeps the same rule."""
    async def go() -> None:
        port = free_port()
        proc, address = await start_cli_server(port=port)
        env = RemoteEnvironment(endpoint(address, max_wait_s=60))
        example, example_address = await start_example()
        other = RemoteEnvironment(endpoint(example_address, name="example"))
        try:
            await env.start("R/0", PROMPT)
            assert (await env.step("R/0", 0, "", ADD)).messages[0].content == "579"
            await stop(proc)
            proc, _ = await start_cli_server(port=port)
            with pytest.raises(NotFound, match=r"environment endpoint 'calc'.*'R/0'.*reward is unknown"):
                await env.close("R/0")
            await other.start("E/0", PROMPT)
            assert (await other.close("E/0")).reward == 0.0
            with pytest.raises(NotFound, match="no session 'E/1'"):
                await other.close("E/1")
        finally:
            for e in (env, other):
                await e.aclose()
            await stop(proc)
            await stop(example)

    asyncio.run(go())


def test_an_endpoint_that_stays_down_fails_with_unavailable_naming_it() -> None:
    async def go() -> None:
        env = RemoteEnvironment(endpoint(f"127.0.0.1:{free_port()}", max_wait_s=0.5))
        with pytest.raises(Unavailable, match=r"environment endpoint 'calc' .*max_wait_s=0.5"):
            await asyncio.wait_for(env.start("L2/0", PROMPT), 60)
        await env.aclose()

    asyncio.run(go())


Handler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


async def start_raw_server(handler: Handler) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    method = grpc.unary_unary_rpc_method_handler(handler, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("meshrl.v1.EnvironmentService", {"Step": method})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def not_a_proto(request: bytes, context: Any) -> bytes:
    return b"\xff\xff\xff this is not a StepResponse"


async def wrong_turn(request: bytes, context: Any) -> bytes:
    req = pb.StepRequest.FromString(request)
    return pb.StepResponse(session_id=req.session_id, turn=req.turn + 1).SerializeToString()


async def bad_role(request: bytes, context: Any) -> bytes:
    req = pb.StepRequest.FromString(request)
    return pb.StepResponse(session_id=req.session_id, turn=req.turn, messages=[{"role": "assistant", "content": "x"}]).SerializeToString()


async def rejects(request: bytes, context: Any) -> bytes:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tool_calls[0].arguments_json: too long")
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("handler", "reason"),
    [
        (not_a_proto, "not a meshrl.v1.StepResponse"),
        (wrong_turn, "expected ('s', turn 0)"),
        (bad_role, "role is 'assistant'"),
        (rejects, "rejected the Step request: tool_calls[0].arguments_json: too long"),
    ],
)
def test_garbage_or_a_refusal_names_the_endpoint(handler: Handler, reason: str) -> None:
    """Garbage is the endpoint's fault (BadReply); a refusal of the request is InvalidArgument
    (the agent loop fails the group on it: tests/unit/test_agent_turn_failures.py)."""
    async def go() -> None:
        server, address = await start_raw_server(handler)
        env = RemoteEnvironment(endpoint(address), index=3)
        with pytest.raises((BadReply, InvalidArgument)) as err:
            await env.step("s", 0, "x", ADD)
        assert isinstance(err.value, InvalidArgument) == (handler is rejects)
        source = err.value.field if isinstance(err.value, InvalidArgument) else err.value.source
        assert source == f"environment endpoint 'calc' ({address}, environment.endpoints[3])"
        assert reason in err.value.reason
        assert env.status()["retries"] == 0  # garbage is not retried
        await env.aclose()
        await server.stop(None)

    asyncio.run(go())


def test_token_is_required_when_the_server_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.common.config import load_config

    async def go() -> None:
        cfg = load_config(None, [f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS}"])
        server = EnvironmentServer(tool_environment(cfg), EnvironmentConfig(token="s3cret"), port=0)
        await server.start()
        monkeypatch.setenv("CALC_TOKEN", "s3cret")
        good = RemoteEnvironment(endpoint(server.address, token_env="CALC_TOKEN"))
        assert (await good.start("t/0", PROMPT)).tools
        bad = RemoteEnvironment(endpoint(server.address, token="wrong"))
        with pytest.raises(Unauthenticated, match=r"environment endpoint 'calc'.*token"):
            await bad.start("t/1", PROMPT)
        for e in (good, bad):
            await e.aclose()
        await server.stop()

    asyncio.run(go())
