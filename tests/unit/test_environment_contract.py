"""The environment contract at its edges: a call nested past the parser is a tool error, turn k+1
waits for turn k's answer, an expired session is NOT_FOUND, a stopping server closes what is open."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition
from services.environment.base import CloseResult, Environment, EnvPrompt, Message, StartResult, StepResult, ToolCall
from services.environment.core import SessionTable
from services.environment.tool_env import ToolEnvironment
from services.environment.tools import load_tools

ROOT = Path(__file__).resolve().parents[2]
TOOLS = str(ROOT / "configs" / "examples" / "tool_add_tools.yaml")
DEEP = '{"a": ' + "[" * (sys.getrecursionlimit() + 100) + "]" * (sys.getrecursionlimit() + 100) + ', "b": 1}'


def test_tool_call_nested_past_the_parser_is_a_tool_error_not_a_raise() -> None:
    """base.py contract: a malformed tool call is answered with an error text, never raised. A
    deeply nested arguments_json (json.loads raises RecursionError, not ValueError) failed the
    whole Step (INTERNAL over gRPC)."""
    async def go() -> None:
        env = ToolEnvironment(load_tools(TOOLS), max_parallel_calls=2)
        await env.start("s", EnvPrompt(text="1+2="))
        r = await env.step("s", 0, "x", [ToolCall("c0", "add", DEEP), ToolCall("c1", "add", '{"a": 1, "b": 2}')])
        assert r.tool_errors == 1 and r.messages[1].content == "3"
        assert "invalid arguments" in r.messages[0].content

    asyncio.run(go())


class GatedEnv(Environment):
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.steps: list[int] = []

    async def start(self, session_id: str, prompt: EnvPrompt, *, sample_index: int = 0, policy_version: int = 0) -> StartResult:
        return StartResult()

    async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *,
                   policy_version: int = 0) -> StepResult:
        self.steps.append(turn)
        await self.gate.wait()
        return StepResult(messages=(Message("user", "ok"),), done=True)

    async def close(self, session_id: str) -> CloseResult:
        return CloseResult()


def test_next_turn_is_refused_while_the_previous_turn_still_runs() -> None:
    """Proto: turn k+1 may only follow turn k. While turn 0 runs (it may still end the episode),
    turn 1 must be FAILED_PRECONDITION, not run beside it in the environment."""
    async def go() -> None:
        env = GatedEnv()
        table = SessionTable(env)
        await table.start("s", EnvPrompt())
        first = asyncio.ensure_future(table.step("s", 0, "a", []))
        await asyncio.sleep(0.01)
        with pytest.raises(FailedPrecondition):
            await asyncio.wait_for(table.step("s", 1, "b", []), 1.0)  # it ran beside turn 0 (TimeoutError)
        env.gate.set()
        assert (await first).done
        assert env.steps == [0]
        with pytest.raises(FailedPrecondition, match="done"):
            await table.step("s", 1, "b", [])

    asyncio.run(go())


def test_example_server_answers_a_deeply_nested_call_with_a_tool_error() -> None:
    sys.path.insert(0, str(ROOT / "examples" / "environment_server"))
    try:
        import server as example  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    from meshrl.v1 import environment_pb2 as pb

    ep = example.CalculatorEpisode(expected="3")
    text, error = ep.answer_call(pb.ToolCall(id="c0", name="add", arguments_json=DEEP))
    assert error and "invalid arguments" in text


class ReleasingEnv(GatedEnv):
    def __init__(self) -> None:
        super().__init__()
        self.closed: list[str] = []

    async def close(self, session_id: str) -> CloseResult:
        self.closed.append(session_id)
        return CloseResult()


def test_server_stop_closes_the_sessions_still_open() -> None:
    """`meshrl environment serve` on SIGTERM: a session still open (its tool instances: sandboxes,
    containers) must be closed in the environment, not dropped with the process."""
    from services.environment.config import EnvironmentConfig
    from services.environment.server import EnvironmentServer

    async def go() -> None:
        env = ReleasingEnv()
        server = EnvironmentServer(env, EnvironmentConfig(), host="127.0.0.1", port=0)
        await server.start()
        await server.table.start("open/0", EnvPrompt())
        await server.stop(None)
        assert env.closed == ["open/0"]

    asyncio.run(go())


def test_a_step_of_an_expired_session_is_not_found() -> None:
    """Proto: NOT_FOUND for an unknown or expired session (FAILED_PRECONDITION is a turn out of
    order). A session the table expired answered its next Step FAILED_PRECONDITION."""
    from services.common.errors import NotFound

    async def go() -> None:
        t = [0.0]
        table = SessionTable(GatedEnv(), session_ttl_s=10, clock=lambda: t[0])
        await table.start("s", EnvPrompt())
        t[0] = 11
        assert await table.expire() == 1
        with pytest.raises(NotFound, match="expired"):
            await table.step("s", 0, "x", [])
        assert (await table.close("s")) == CloseResult()  # a repeated Close still gets the stored answer

    asyncio.run(go())


def test_extra_info_nesting_follows_security_limits_max_json_depth() -> None:
    """A prompt's extra_info nests as deep as `security.limits.max_json_depth` allows (the reward
    service's bound on the same field), on the environment server and on the rollout's side."""
    from meshrl.v1 import common_pb2
    from services.common.config import load_config
    from services.common.errors import InvalidArgument
    from services.common.tiny import build_tokenizer
    from services.environment import convert
    from services.rollout.factory import build_agent, worker_settings

    deep = common_pb2.Prompt(prompt_id="p", extra_info_json='{"a": ' + "[" * 70 + "]" * 70 + "}")
    with pytest.raises(InvalidArgument, match="max_json_depth"):
        convert.prompt_from_proto(deep)  # the default, 64
    assert convert.prompt_from_proto(deep, max_depth=128).extra_info["a"]
    cfg = load_config(None, ["security.limits.max_json_depth=128", "actor_rollout_ref.rollout.multi_turn.enable=true"])
    agent = build_agent(cfg, build_tokenizer(tools=True), worker_settings(cfg, None))
    assert agent.s.max_json_depth == 128
    gateway = build_agent(load_config(None, ["security.limits.max_json_depth=128", "agent.command=[python, a.py]"]),
                          build_tokenizer(tools=True), worker_settings(cfg, None))
    assert gateway.s.max_json_depth == 128
