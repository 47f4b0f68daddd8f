"""What the environment side does with a turn the policy overran or a reward user code got wrong:
the session table bounds a Step (calls past max_tool_calls answered with errors, long texts cut so
an answer always fits a gRPC message) instead of refusing it, and the tool environment reads every
reward a tool or an interaction gives by one finiteness rule. On the client side, an environment
written in another language that answers past those bounds (a reply over the message limit, tool
schemas nested past the JSON limits) fails that call at once, naming the endpoint."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from meshrl.v1 import environment_pb2 as pb
from meshrl.v1 import environment_pb2_grpc
from services.common import endpoints, grpc_util
from services.common.errors import BadReply, DeadlineExceeded
from services.environment import convert
from services.environment.base import EnvPrompt, Message, StepResult, ToolCall
from services.environment.client import RemoteEnvironment
from services.environment.config import EnvironmentConfig, EnvironmentEndpointConfig
from services.environment.core import SessionTable
from services.environment.tool_env import ToolEnvironment
from services.environment.tools import load_tools
from tests.unit.test_environment import TOOLS, CountingEnv


class HugeToolEnv(CountingEnv):
    """Answers each call with `size` copies of `char` (a tool that prints a whole file)."""

    def __init__(self, size: int, char: str = "x") -> None:
        super().__init__()
        self.size, self.char = size, char
        self.texts: list[str] = []
        self.calls_seen: list[int] = []

    async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *,
                   policy_version: int = 0) -> StepResult:
        self.texts.append(assistant_text)
        self.calls_seen.append(len(tool_calls))
        text = self.char * self.size  # one string, shared by every long message
        msgs = [Message("tool", "short"), *(Message("tool", text) for _ in tool_calls[1:])]
        return StepResult(messages=tuple(msgs), tool_errors=1, metrics={"m": 1.0})


def test_the_session_table_bounds_a_turn_instead_of_refusing_it() -> None:
    """Calls past max_tool_calls are answered with tool errors without running, a long assistant
    text is cut before the environment reads it, and an answer is cut to max_message_chars in all
    (short messages whole, the long ones sharing the rest, both ends kept) before it is stored:
    the repeat of a turn gets the same bounded answer."""
    async def go() -> None:
        env = HugeToolEnv(size=5000)
        table = SessionTable(env, max_tool_calls=3, max_message_chars=1000)
        await table.start("s", EnvPrompt())
        calls = [ToolCall(f"c{i}", "f", "{}") for i in range(5)]
        r = await table.step("s", 0, "a" * 600 + "b" * 600, calls)
        assert env.calls_seen == [3] and len(env.texts[0]) < 1100 and env.texts[0].startswith("a" * 500)
        assert "(truncated)" in env.texts[0] and env.texts[0].endswith("b" * 500)
        assert [m.role for m in r.messages] == ["tool"] * 5 and r.messages[0].content == "short"
        assert all("environment.max_tool_calls=3" in m.content and m.error for m in r.messages[3:])
        assert r.tool_errors == 1 + 2 and r.metrics["m"] == 1.0 and r.metrics["server_truncated_messages"] == 2
        long = [m.content for m in r.messages[1:3]]
        assert all(x.startswith("x" * 100) and "...(truncated)..." in x and x.endswith("x" * 100) for x in long)
        assert sum(len(m.content) for m in r.messages) <= 1000 + 2 * len("...(truncated)...")
        assert await table.step("s", 0, "again", calls) is r and env.calls_seen == [3]
        assert table.status()["truncated_messages"] == 2

    asyncio.run(go())


def test_a_served_error_text_keeps_its_mark_and_its_bound() -> None:
    """An error answer (Message.error) crosses the wire marked, so the rollout shows it whole as in
    process; past max_message_chars the server still cuts it like any answer (a tool that raised
    with a huge message), and the cut text is still marked. bound_messages rebuilt a cut message
    without the mark."""
    class HugeErrorEnv(CountingEnv):
        async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *,
                       policy_version: int = 0) -> StepResult:
            return StepResult(messages=(Message("tool", "Error: " + "e" * 5000, error=True), Message("tool", "ok")),
                              tool_errors=1)

    async def go() -> None:
        table = SessionTable(HugeErrorEnv(), max_message_chars=1000)
        await table.start("s", EnvPrompt())
        r = await table.step("s", 0, "", [ToolCall("c0", "f", "{}"), ToolCall("c1", "f", "{}")])
        again = convert.step_from_reply(convert.step_response("s", 0, r), "s", 0, "environment endpoint 'ep'")
        assert [(m.content[:7], m.error) for m in again.messages] == [("Error: ", True), ("ok", False)]
        assert "...(truncated)..." in again.messages[0].content and len(again.messages[0].content) < 1100
        assert r.metrics["server_truncated_messages"] == 1

    asyncio.run(go())


def test_a_step_answer_always_fits_a_grpc_message() -> None:
    """Every message at once at its longest, in 3-byte characters, with the defaults: the answer
    stays far below the 64 MiB gRPC limit (unbounded, it was retried and refused for ever)."""
    from services.common.grpc_util import DEFAULT_MAX_MESSAGE_BYTES

    async def go() -> None:
        cfg = EnvironmentConfig()
        table = SessionTable(HugeToolEnv(size=cfg.max_message_chars, char="€"), max_tool_calls=cfg.max_tool_calls,
                             max_message_chars=cfg.max_message_chars)
        await table.start("s", EnvPrompt())
        r = await table.step("s", 0, "", [ToolCall(f"c{i}", "f", "{}") for i in range(cfg.max_tool_calls)])
        assert len(r.messages) == cfg.max_tool_calls
        assert convert.step_response("s", 0, r).ByteSize() < DEFAULT_MAX_MESSAGE_BYTES // 8

    asyncio.run(go())


class NaNJudge:
    """A verl-style interaction whose turn score is NaN."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    async def start_interaction(self, instance_id: str, **kwargs: Any) -> str:
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        return True, "done", float("nan"), {}

    async def finalize_interaction(self, instance_id: str) -> None:
        return None


def test_non_finite_interaction_scores_and_calc_rewards_count_as_zero_like_step_rewards() -> None:
    """One rule for every reward a tool or an interaction gives: not a finite number -> 0.0,
    counted (a NaN used to reach the rollout, which stopped the replica)."""
    async def go() -> None:
        tools = load_tools(TOOLS)

        async def nan_reward(instance_id: str, **kw: Any) -> float:
            return float("inf")

        async def nan_step(instance_id: str, parameters: dict[str, Any], **kw: Any) -> tuple[str, float, dict[str, Any]]:
            return "579", float("nan"), {}

        tools[0].calc_reward = nan_reward  # type: ignore[method-assign]
        tools[0].execute = nan_step  # type: ignore[method-assign]
        env = ToolEnvironment(tools, {"judge": NaNJudge({})})  # type: ignore[dict-item]
        await env.start("s", EnvPrompt(messages=(Message("user", "123+456="),)))
        step = await env.step("s", 0, "call", [ToolCall("c0", "add", '{"a": 1, "b": 2}')])
        judged = await env.step("s", 1, "579", [])
        closed = await env.close("s")
        assert (step.reward, judged.reward, closed.reward) == (0.0, 0.0, 0.0)
        assert env.status()["bad_rewards"] == 3

    asyncio.run(go())


def test_tool_metrics_that_are_not_finite_or_overflow_their_sum_are_dropped_and_counted() -> None:
    """A tool's metrics are read by the rewards' rule: a value that is no finite float (NaN, an int
    past a float's range) and a per-turn sum that overflows are dropped and counted. The int raised
    OverflowError out of Step (the group failed on every replica), and 1e308 twice summed to inf,
    which a served environment's client refuses as BadReply."""
    async def go() -> None:
        tools = load_tools(TOOLS)

        async def big_metrics(instance_id: str, parameters: dict[str, Any], **kw: Any) -> tuple[str, float, dict[str, Any]]:
            return "3", 0.0, {"big": 1e308, "huge_int": 10**400, "nan": float("nan"), "calls": 1}

        tools[0].execute = big_metrics  # type: ignore[method-assign]
        env = ToolEnvironment(tools, max_parallel_calls=2)
        await env.start("s", EnvPrompt(messages=(Message("user", "1+2="),)))
        step = await env.step("s", 0, "call", [ToolCall("c0", "add", '{"a": 1, "b": 2}'),
                                               ToolCall("c1", "add", '{"a": 1, "b": 2}')])
        assert dict(step.metrics) == {"calls": 2.0} and step.tool_errors == 0
        assert env.status()["bad_metrics"] == 5  # huge_int and nan of each call, the overflowing sum of big
        # a served ToolEnvironment's answer passes its client's check
        reply = convert.step_response("s", 0, step)
        assert dict(convert.step_from_reply(reply, "s", 0, "env").metrics) == {"calls": 2.0}

    asyncio.run(go())


def test_a_hung_tool_is_answered_with_an_error_after_tool_timeout_s() -> None:
    """In process nothing bounded a tool call: a tool that never returns (a sandbox that hangs)
    held its Step, its group and the lease (renewed while tools run) forever. Now its call is
    cancelled after multi_turn.tool_timeout_s and answered with an error; the episode goes on."""
    async def go() -> None:
        tools = load_tools(TOOLS)
        cancelled = asyncio.Event()

        async def hang(instance_id: str, parameters: dict[str, Any], **kw: Any) -> tuple[str, float, dict[str, Any]]:
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()
            raise AssertionError("unreachable")

        tools[0].execute = hang  # type: ignore[method-assign]
        env = ToolEnvironment(tools, call_timeout_s=0.05)
        await env.start("s", EnvPrompt(messages=(Message("user", "1+2="),)))
        step = await asyncio.wait_for(env.step("s", 0, "call", [ToolCall("c0", "add", '{"a": 1, "b": 2}')]), 5.0)
        assert step.tool_errors == 1 and not step.done and cancelled.is_set()
        assert "did not answer within 0.05s" in step.messages[0].content
        assert "tool_timeout_s" in step.messages[0].content
        assert (await env.close("s")).reward == 0.0

    asyncio.run(go())


def test_a_hung_interaction_or_calc_reward_fails_with_deadline_exceeded() -> None:
    """The other calls of user code are bounded as well; past the limit they fail the group
    (DeadlineExceeded naming the call and the key), and a close still releases every instance."""
    async def go() -> None:
        class HungJudge(NaNJudge):
            async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                        **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
                await asyncio.Event().wait()
                raise AssertionError("unreachable")

        tools = load_tools(TOOLS)
        released: list[str] = []

        async def hang(instance_id: str, **kw: Any) -> float:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async def release(instance_id: str, **kw: Any) -> None:
            released.append(instance_id)

        tools[0].calc_reward = hang  # type: ignore[method-assign]
        tools[0].release = release  # type: ignore[method-assign]
        env = ToolEnvironment(tools, {"judge": HungJudge({})}, call_timeout_s=0.05)  # type: ignore[dict-item]
        await env.start("s", EnvPrompt(messages=(Message("user", "1+2="),)))
        await env.step("s", 0, "call", [ToolCall("c0", "add", '{"a": 1, "b": 2}')])
        with pytest.raises(DeadlineExceeded, match=r"generate_response did not finish within 0.05s.*tool_timeout_s"):
            await asyncio.wait_for(env.step("s", 1, "3", []), 5.0)
        with pytest.raises(DeadlineExceeded, match="calc_reward did not finish"):
            await asyncio.wait_for(env.close("s"), 5.0)
        assert released == ["s/add"]

    asyncio.run(go())


def test_tool_timeout_s_reaches_the_tool_environment() -> None:
    from services.common.config import load_config
    from services.environment import factory

    cfg = load_config(None, ["actor_rollout_ref.rollout.multi_turn.tool_timeout_s=7.5"])
    assert factory.tool_environment(cfg).call_timeout_s == 7.5


class _HugeStep(environment_pb2_grpc.EnvironmentServiceServicer):
    """An environment in any language whose tool printed a huge file: its Step answer is 2 MiB."""

    def __init__(self) -> None:
        self.steps = 0

    async def Step(self, request: pb.StepRequest, context: Any) -> pb.StepResponse:
        self.steps += 1
        return pb.StepResponse(session_id=request.session_id, turn=request.turn,
                               messages=[{"role": "tool", "content": "x" * (2 << 20)}])


def test_a_reply_over_the_message_limit_fails_its_call_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply over the client's receive limit is RESOURCE_EXHAUSTED on the client side. It was
    retried: the endpoint answered each retry with the same reply, the breaker every session of the
    endpoint shares tripped, and the trajectory failed only after max_wait_s, as Unavailable."""
    monkeypatch.setattr(endpoints, "message_options", lambda: grpc_util.message_options(1 << 20))

    async def go() -> None:
        server = grpc.aio.server()
        env_server = _HugeStep()
        environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(env_server, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        env = RemoteEnvironment(EnvironmentEndpointConfig(address=f"127.0.0.1:{port}", max_retries=2,
                                                          backoff_initial_s=0.01, backoff_max_s=0.01, max_wait_s=1.0,
                                                          breaker_open_s=0.05, breaker_max_open_s=0.05))
        try:
            with pytest.raises(BadReply, match="larger than max"):
                await env.step("s", 0, "text", [])
            assert env_server.steps == 1, f"the Step was sent {env_server.steps} times"
            assert env.endpoint.breaker.state is endpoints.BreakerState.CLOSED
        finally:
            await env.aclose()
            await server.stop(0)

    asyncio.run(go())


_DEEP = sys.getrecursionlimit() + 100


@pytest.mark.parametrize("text", [
    "[" * _DEEP + "]" * _DEEP,
    '{"type": "function", "function": {"name": "f", "x": ' + "[" * _DEEP + "]" * _DEEP + "}}",
    '{"type": "function", "function": {"name": "f", "x": ' + "1" * 5000 + "}}",
], ids=["deep", "deep-inside", "long-integer"])
def test_tools_json_past_the_json_limits_is_a_bad_reply(text: str) -> None:
    """tools_json was parsed with plain json.loads: a deep document raised a bare RecursionError and
    an integer past Python's digit limit a ValueError, neither naming the endpoint."""
    with pytest.raises(BadReply, match=r"environment endpoint 'ep'.*tools_json\[0\]"):
        convert.start_from_reply(pb.StartResponse(session_id="s", tools_json=[text]), "s", "environment endpoint 'ep'")
