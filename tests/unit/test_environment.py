"""Environments without a network: the session table's idempotency and bounds, the verl-style tool
environment (malformed calls answered and counted), the tool / interaction YAML loaders, the
environment config rules, and reply validation naming the endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import json
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from meshrl.v1 import environment_pb2 as pb
from services.common.errors import (
    BadReply,
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from services.environment import convert
from services.environment.base import CloseResult, Environment, EnvPrompt, Message, StartResult, StepResult, ToolCall
from services.environment.config import EnvironmentConfig, EnvironmentEndpointConfig
from services.environment.core import SessionTable
from services.environment.tool_env import ToolEnvironment
from services.environment.tools import BaseTool, OpenAIFunctionToolSchema, load_interactions, load_tools

ROOT = Path(__file__).resolve().parents[2]
TOOLS = str(ROOT / "configs" / "examples" / "tool_add_tools.yaml")


class CountingEnv(Environment):
    """Counts what reaches it; a step may be told to fail once or to wait for a gate."""

    def __init__(self) -> None:
        self.starts: list[str] = []
        self.steps: list[tuple[str, int]] = []
        self.closes: list[str] = []
        self.fail_next_step = False
        self.gate: asyncio.Event | None = None

    async def start(self, session_id: str, prompt: EnvPrompt, *, sample_index: int = 0, policy_version: int = 0) -> StartResult:
        self.starts.append(session_id)
        return StartResult(tools=({"type": "function", "function": {"name": "f"}},), max_turns=3)

    async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *,
                   policy_version: int = 0) -> StepResult:
        self.steps.append((session_id, turn))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("flaky")
        return StepResult(messages=(Message("user", f"turn {turn}: {assistant_text}"),), done=turn >= 1, reward=0.5)

    async def close(self, session_id: str) -> CloseResult:
        self.closes.append(session_id)
        return CloseResult(reward=1.0, metrics={"x": 2.0})


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_session_table_acts_once_per_key() -> None:
    async def go() -> None:
        env = CountingEnv()
        table = SessionTable(env)
        a = await table.start("s", EnvPrompt())
        b = await table.start("s", EnvPrompt())
        assert a == b and env.starts == ["s"]
        r0 = await table.step("s", 0, "hi", [])
        assert await table.step("s", 0, "hi", []) == r0  # the retry gets the stored answer
        assert env.steps == [("s", 0)]
        with pytest.raises(FailedPrecondition, match="out of order"):
            await table.step("s", 2, "x", [])
        r1 = await table.step("s", 1, "again", [])
        assert r1.done
        with pytest.raises(FailedPrecondition, match="done"):
            await table.step("s", 2, "x", [])
        c1, c2 = await table.close("s"), await table.close("s")
        assert c1 == c2 and env.closes == ["s"] and c1.reward == 1.0
        with pytest.raises(FailedPrecondition, match="closed"):
            await table.step("s", 2, "x", [])
        with pytest.raises(NotFound):
            await table.step("never", 0, "x", [])
        # Never started, or lost: the close reward is unknown, so no empty answer (the trajectory
        # would be trained without it).
        with pytest.raises(NotFound, match="its reward is unknown"):
            await table.close("never")

    asyncio.run(go())


def test_concurrent_repeats_share_one_attempt_and_a_failure_can_be_retried() -> None:
    async def go() -> None:
        env = CountingEnv()
        table = SessionTable(env)
        await table.start("s", EnvPrompt())
        env.gate = asyncio.Event()
        first = asyncio.ensure_future(table.step("s", 0, "a", []))
        second = asyncio.ensure_future(table.step("s", 0, "a", []))
        await asyncio.sleep(0.01)
        env.gate.set()
        assert await first == await second and env.steps == [("s", 0)]
        env.fail_next_step = True
        with pytest.raises(RuntimeError):
            await table.step("s", 1, "b", [])
        assert (await table.step("s", 1, "b", [])).done  # the failed turn runs again
        assert env.steps == [("s", 0), ("s", 1), ("s", 1)]

    asyncio.run(go())


def test_session_table_bounds_and_expiry() -> None:
    async def go() -> None:
        env, clock = CountingEnv(), Clock()
        table = SessionTable(env, max_sessions=2, session_ttl_s=10, clock=clock)
        await table.start("a", EnvPrompt())
        await table.start("b", EnvPrompt())
        with pytest.raises(ResourceExhausted, match="max_sessions=2"):
            await table.start("c", EnvPrompt())
        clock.t = 5
        await table.step("b", 0, "x", [])
        clock.t = 12
        assert await table.expire() == 1  # a idle 12 s; b seen 7 s ago
        assert env.closes == ["a"] and table.open_sessions == 1
        await table.start("c", EnvPrompt())

    asyncio.run(go())


def test_a_hung_call_holds_neither_its_close_nor_the_other_sessions_expiry() -> None:
    """A tool that never returns (no timeout in its sandbox) and a rollout that gave up: the
    expiry still closes every stale session, the hung call cancelled after close_wait_s. A Step
    that arrives while its session closes is refused (it would run beside, or after, env.close),
    and a rejected Step does not count as the session being alive."""
    async def go() -> None:
        env, clock = CountingEnv(), Clock()
        table = SessionTable(env, session_ttl_s=10, close_wait_s=0.2, clock=clock)
        await table.start("hung", EnvPrompt())
        await table.start("other", EnvPrompt())
        env.gate = asyncio.Event()  # never set: the step hangs
        caller = asyncio.ensure_future(table.step("hung", 0, "x", []))
        await asyncio.sleep(0.01)
        caller.cancel()  # the rollout's call timed out
        clock.t = 8
        with pytest.raises(FailedPrecondition, match="out of order"):
            await table.step("other", 3, "x", [])  # rejected: "other" stays idle since 0
        clock.t = 11
        assert await asyncio.wait_for(table.expire(), timeout=5) == 2
        assert sorted(env.closes) == ["hung", "other"] and table.open_sessions == 0

        await table.start("s", EnvPrompt())
        env.gate = asyncio.Event()
        running = asyncio.ensure_future(table.step("s", 0, "x", []))
        await asyncio.sleep(0.01)
        closing = asyncio.ensure_future(table.close("s"))
        await asyncio.sleep(0.01)
        with pytest.raises(FailedPrecondition, match="closing"):
            await table.step("s", 1, "y", [])
        env.gate.set()
        await running
        assert (await closing).reward == 1.0 and ("s", 1) not in env.steps

    asyncio.run(go())


class FailingClose(CountingEnv):
    async def close(self, session_id: str) -> CloseResult:
        self.closes.append(session_id)
        from services.common.errors import Unavailable

        raise Unavailable("the reward sandbox is down")


def test_a_failed_close_fails_its_repeats_too_never_an_empty_reward() -> None:
    """The client retries UNAVAILABLE: the retry must not get CloseResult(reward=None), which the
    trajectory would be trained on without its environment reward."""
    async def go() -> None:
        env = FailingClose()
        table = SessionTable(env)
        await table.start("s", EnvPrompt())
        with pytest.raises(Exception, match="sandbox is down"):
            await table.close("s")
        with pytest.raises(FailedPrecondition, match="reward is unknown"):
            await table.close("s")
        assert env.closes == ["s"] and table.open_sessions == 0

    asyncio.run(go())


def test_a_close_the_table_cannot_answer_is_not_found_never_an_empty_reward() -> None:
    """A server restarted between a session's last Step and its Close, or a repeat of a Close whose
    answer is no longer kept: the reward is unknown, and CloseResult(reward=None) would have the
    trajectory trained without it. The rollout fails the group on NotFound (its prompt goes back)."""
    async def go() -> None:
        env = CountingEnv()
        table = SessionTable(env, closed_keep=1)
        for sid in ("a", "b"):
            await table.start(sid, EnvPrompt())
            await table.step(sid, 0, "x", [])
        restarted = SessionTable(env)
        with pytest.raises(NotFound, match="lost in a restart"):
            await restarted.close("a")
        assert (await table.close("a")).reward == 1.0 and (await table.close("b")).reward == 1.0
        assert (await table.close("b")).reward == 1.0  # the kept answer
        with pytest.raises(NotFound, match="its reward is unknown"):
            await table.close("a")  # its answer gave way to b's
        assert env.closes == ["a", "b"]

    asyncio.run(go())


# ---- the tool environment --------------------------------------------------------------------------


def _calls(*specs: tuple[str, str]) -> list[ToolCall]:
    return [ToolCall(f"c{i}", name, args) for i, (name, args) in enumerate(specs)]


def test_tool_environment_answers_good_and_malformed_calls() -> None:
    async def go() -> None:
        env = ToolEnvironment(load_tools(TOOLS), max_parallel_calls=4)
        start = await env.start("s", EnvPrompt(messages=(Message("user", "123+456="),)))
        assert start.tools[0]["function"]["name"] == "add"
        calls = [*_calls(("add", '{"a": 123, "b": 456}'), ("sub", '{"a": 1}'), ("add", '{"a": "x", "b": 1}'),
                         ("add", "[1, 2]")), ToolCall("c4", "", "{not json", parse_error="invalid JSON")]
        r = await env.step("s", 0, "<tool_call>...</tool_call>", calls)
        texts = [m.content for m in r.messages]
        assert [m.role for m in r.messages] == ["tool"] * 5
        assert texts[0] == "579"
        assert "unknown tool 'sub'" in texts[1]
        assert "a must be an integer" in texts[2]
        assert "JSON object" in texts[3]
        assert "max_parallel_calls=4" in texts[4]  # the 5th call is over the limit: not run
        assert r.tool_errors == 4 and not r.done and r.reward == 0.0
        parse = await env.step("s", 1, "?", [ToolCall("c5", "", "{not json", parse_error="invalid JSON")])
        assert "could not be parsed: invalid JSON" in parse.messages[0].content and parse.tool_errors == 1
        done = await env.step("s", 2, "579", [])
        assert done.done and done.messages == ()
        closed = await env.close("s")
        assert closed.reward == 0.0 and env.status()["open_sessions"] == 0

    asyncio.run(go())


class EchoUser:
    """A verl-style interaction (duck-typed like a user's class): ends the episode at turn 2."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.turns: dict[str, int] = {}

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        self.turns[str(instance_id)] = 0
        return str(instance_id)

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        self.turns[instance_id] += 1
        return self.turns[instance_id] >= 2, f"you said {messages[-1]['content']}", 0.25, {"turn": 1.0}

    async def finalize_interaction(self, instance_id: str) -> None:
        self.turns.pop(instance_id)


def test_interaction_answers_turns_without_tool_calls(tmp_path: Path) -> None:
    path = tmp_path / "interaction.yaml"
    path.write_text(f"interaction:\n  - name: echo\n    class_name: {__name__}.EchoUser\n    config: {{}}\n")
    interactions = load_interactions(str(path))

    async def go() -> None:
        env = ToolEnvironment([], interactions)
        await env.start("s", EnvPrompt(messages=(Message("user", "hi"),), extra_info={"interaction_kwargs": {"name": "echo"}}))
        r0 = await env.step("s", 0, "hello", [])
        assert r0.messages == (Message("user", "you said hello"),) and not r0.done and r0.reward == 0.25
        assert (await env.step("s", 1, "bye", [])).done
        await env.close("s")
        assert interactions["echo"].turns == {}  # type: ignore[attr-defined]
        with pytest.raises(InvalidArgument, match=r"interaction_kwargs\.name"):
            await env.start("t", EnvPrompt(extra_info={"interaction_kwargs": {"name": "nobody"}}))

    asyncio.run(go())


class FlakyTool:
    """A tool whose instance creation fails once, and whose reward fails at close."""

    name = "flaky"
    tool_schema = type("S", (), {"model_dump": staticmethod(lambda **_: {"type": "function", "function": {"name": "flaky"}})})()

    def __init__(self) -> None:
        self.creates = 0
        self.released: list[str] = []

    async def create(self, instance_id: str, **kwargs: Any) -> tuple[str, None]:
        self.creates += 1
        if self.creates == 1:
            raise RuntimeError("sandbox busy")
        return instance_id, None

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
        return "ok", 0.0, {}

    async def calc_reward(self, instance_id: str) -> float:
        raise RuntimeError("grader down")

    async def release(self, instance_id: str) -> None:
        self.released.append(instance_id)


def test_a_failed_turn_leaves_the_history_as_it_was_and_a_failed_close_still_releases() -> None:
    async def go() -> None:
        tool = FlakyTool()
        other = load_tools(TOOLS)[0]
        env = ToolEnvironment([tool, other], max_parallel_calls=2)  # type: ignore[list-item]
        await env.start("s", EnvPrompt(messages=(Message("user", "hi"),)))
        calls = _calls(("add", '{"a": 1, "b": 2}'), ("flaky", "{}"))
        with pytest.raises(RuntimeError, match="sandbox busy"):
            await env.step("s", 0, "call them", calls)
        assert env._sessions["s"].history == [{"role": "user", "content": "hi"}]
        r = await env.step("s", 0, "call them", calls)  # the retry
        assert [m.content for m in r.messages] == ["3", "ok"]
        assert [m["role"] for m in env._sessions["s"].history] == ["user", "assistant", "tool", "tool"]
        with pytest.raises(RuntimeError, match="grader down"):
            await env.close("s")
        assert tool.released == ["s/flaky"] and env.status()["open_sessions"] == 0

    asyncio.run(go())


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"interaction_kwargs": "abc"}, "interaction_kwargs"),
        ({"interaction_kwargs": {"name": "echo", "instance_id": "z"}}, r"interaction_kwargs\.instance_id"),
        ({"interaction_kwargs": {"name": [1]}}, r"interaction_kwargs\.name"),
        ({"tools_kwargs": ["x"]}, "tools_kwargs"),
        ({"tools_kwargs": {"add": {"create_kwargs": 3}}}, r"tools_kwargs\.add"),
    ],
)
def test_bad_extra_info_is_refused_at_start_naming_the_key(tmp_path: Path, extra: dict[str, Any], field: str) -> None:
    path = tmp_path / "interaction.yaml"
    path.write_text(f"interaction:\n  - name: echo\n    class_name: {__name__}.EchoUser\n    config: {{}}\n")

    async def go() -> None:
        env = ToolEnvironment(load_tools(TOOLS), load_interactions(str(path)))
        with pytest.raises(InvalidArgument, match=field):
            await env.start("s", EnvPrompt(extra_info=extra))
        assert env.status()["open_sessions"] == 0

    asyncio.run(go())


def test_extra_info_nested_past_the_parser_is_invalid_argument() -> None:
    from meshrl.v1 import common_pb2

    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(InvalidArgument, match="nest"):
        convert.prompt_from_proto(common_pb2.Prompt(extra_info_json='{"a": ' + deep + "}"))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("tools: []\n", "non-empty list under `tools:`"),
        ("tools:\n  - class_name: no.such.module.Tool\n    config: {type: native}\n", r"tools\[0\].class_name 'no.such.module.Tool': cannot import"),
        ("tools:\n  - class_name: services.environment.builtin.Nope\n", "has no class 'Nope'"),
        ("tools:\n  - class_name: services.environment.builtin.AddTool\n    config: {type: mcp}\n", r"tools\[0\].config.type='mcp'"),
        ("tools:\n  - class_name: services.environment.builtin.AddTool\n    tool_schema: {type: function, function: {description: x}}\n",
         r"tools\[0\].tool_schema.function.name"),
        ("tools:\n  - class_name: services.environment.builtin.AddTool\n    tool_schema: {function: {name: add}}\n"
         "  - class_name: services.environment.builtin.AddTool\n    tool_schema: {function: {name: add}}\n", r"tools\[1\] is called 'add'"),
        ("tools:\n  - class_name: services.environment.builtin.AddTool\n    schema: {}\n", "unknown keys"),
        ("tools:\n  - class_name: json.JSONDecoder\n", "lacks async"),
    ],
)
def test_bad_tool_yaml_names_the_entry_and_the_fix(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        load_tools(str(path))
    assert "tool_config_path" in str(err.value)


def test_missing_yaml_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_tools("/nonexistent/tools.yaml")


def test_environment_config_rules() -> None:
    with pytest.raises(ValidationError, match="already routed"):
        EnvironmentConfig(endpoints=[EnvironmentEndpointConfig(address="h:1", data_sources=["a"]),
                                     EnvironmentEndpointConfig(address="h:2", data_sources=["a"])])
    with pytest.raises(ValidationError, match="environment endpoint address"):
        EnvironmentEndpointConfig(address="nohost")
    assert EnvironmentEndpointConfig(address="h:1").max_wait_s == 60.0  # finite: the prompt goes back


# ---- what an endpoint sends back -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resp", "reason"),
    [
        (pb.StepResponse(session_id="other", turn=0), "expected ('s', turn 0)"),
        (pb.StepResponse(session_id="s", turn=1), "expected ('s', turn 0)"),
        (pb.StepResponse(session_id="s", turn=0, reward=float("nan")), "reward is not finite"),
        (pb.StepResponse(session_id="s", turn=0, metrics={"m": float("inf")}), "not finite"),
        (pb.StepResponse(session_id="s", turn=0, messages=[{"role": "assistant", "content": "x"}]), "role is 'assistant'"),
    ],
)
def test_garbage_step_replies_name_the_endpoint(resp: pb.StepResponse, reason: str) -> None:
    with pytest.raises(BadReply) as err:  # the endpoint's fault: a rollout stops on InvalidArgument
        convert.step_from_reply(resp, "s", 0, "environment endpoint 'calc'")
    assert err.value.source == "environment endpoint 'calc'" and reason in err.value.reason


def test_start_reply_tools_must_be_function_json() -> None:
    with pytest.raises(BadReply, match="not valid JSON"):
        convert.start_from_reply(pb.StartResponse(session_id="s", tools_json=["{"]), "s", "ep")
    with pytest.raises(BadReply, match="OpenAI function tool"):
        convert.start_from_reply(pb.StartResponse(session_id="s", tools_json=['{"type": "function"}']), "s", "ep")
    ok = convert.start_from_reply(pb.StartResponse(session_id="s", tools_json=[json.dumps({"function": {"name": "f"}})]), "s", "ep")
    assert ok.tools[0]["function"]["name"] == "f"


def test_step_request_validation() -> None:
    """Ids are the client's to get right; how many calls and how long a text are the sampled
    turn's, bounded by the session table (a refusal stopped the rollout replica)."""
    req = pb.StepRequest(session_id="s", tool_calls=[pb.ToolCall(id="a"), pb.ToolCall(id="a")])
    with pytest.raises(InvalidArgument) as err:
        convert.tool_calls_from_request(req)
    assert err.value.field == "tool_calls[1].id"
    many = pb.StepRequest(session_id="s", assistant_text="x" * 1000, tool_calls=[pb.ToolCall(id=f"c{i}") for i in range(65)])
    assert len(convert.tool_calls_from_request(many)) == 65


def test_a_verl_tool_file_works_with_its_imports_changed(tmp_path: Path) -> None:
    """verl's gsm8k demo tool and its YAML: create_kwargs from extra_info.tools_kwargs reach create,
    step rewards and calc_reward make the environment's reward, the instance is released."""
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(
        "tools:\n  - class_name: tests.unit.agent_fixtures.verl_style_tool.Gsm8kTool\n    config: {type: native}\n"
        "    tool_schema:\n      type: function\n      function:\n        name: calc_gsm8k_reward\n"
        "        description: A tool for calculating the reward of gsm8k\n"
        "        parameters: {type: object, properties: {answer: {type: string, description: The answer}}, required: [answer]}\n"
    )
    (tool,) = load_tools(str(path))

    async def go() -> tuple[StepResult, StepResult, CloseResult]:
        env = ToolEnvironment([tool])
        prompt = EnvPrompt(messages=(Message("user", "2+2?"),),
                           extra_info={"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "4"}}}})
        await env.start("s", prompt)
        wrong = await env.step("s", 0, "", [ToolCall("c0", "calc_gsm8k_reward", '{"answer": "5"}')])
        right = await env.step("s", 1, "", [ToolCall("c1", "calc_gsm8k_reward", '{"answer": "4"}')])
        return wrong, right, await env.close("s")

    wrong, right, closed = asyncio.run(go())
    assert "reward=0.0" in wrong.messages[0].content and wrong.reward == -0.05
    assert "reward=1.0" in right.messages[0].content and right.reward == 0.0
    assert closed.reward == 1.0 and tool._instance_dict == {}  # type: ignore[attr-defined]


class SlowStartEnv(Environment):
    """An environment whose close can fail and whose start can ignore its cancellation."""

    def __init__(self, *, close_fails: bool = False, start_ignores_cancel_s: float = 0.0) -> None:
        self.close_fails = close_fails
        self.start_ignores_cancel_s = start_ignores_cancel_s
        self.gate = asyncio.Event()
        self.closes: list[str] = []
        self.started: list[str] = []

    async def start(self, session_id: str, prompt: EnvPrompt, *, sample_index: int = 0, policy_version: int = 0) -> StartResult:
        if self.start_ignores_cancel_s:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                await asyncio.sleep(self.start_ignores_cancel_s)  # e.g. a sandbox that finishes booting
        self.started.append(session_id)
        return StartResult()

    async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *,
                   policy_version: int = 0) -> StepResult:
        return StepResult(done=True)

    async def close(self, session_id: str) -> CloseResult:
        self.closes.append(session_id)
        if self.close_fails:
            raise Unavailable("the grader is down")
        return CloseResult(reward=1.0)


def test_repeated_close_of_a_failed_session_does_not_grow_its_stored_error() -> None:
    """A failed close's FailedPrecondition is kept for repeats; raising the same object again must
    not pile each caller's frames (and their locals: the request, the gRPC context) onto it."""
    async def go() -> None:
        table = SessionTable(SlowStartEnv(close_fails=True))
        await table.start("s", EnvPrompt())
        with pytest.raises(Unavailable):
            await table.close("s")
        depths = []
        for _ in range(3):
            try:
                await table.close("s")
            except FailedPrecondition as exc:
                depths.append(len(traceback.extract_tb(exc.__traceback__)))
        assert depths[0] == depths[-1], f"traceback frames per repeat: {depths}"

    asyncio.run(go())


def test_close_of_a_session_whose_start_ignores_cancellation() -> None:
    """A Close while the start still runs cancels it after close_wait_s; a start that ignores its
    cancellation and lands later is closed in the environment then, and the Close itself answers
    (it failed INTERNAL with InvalidStateError, and the session was never closed)."""
    async def go() -> None:
        env = SlowStartEnv(start_ignores_cancel_s=1.5)
        table = SessionTable(env, close_wait_s=0.05)
        caller = asyncio.ensure_future(table.start("s", EnvPrompt()))
        await asyncio.sleep(0.01)
        error: BaseException | None = None
        try:
            await table.close("s")  # the rollout gave up on this trajectory
        except Exception as exc:
            error = exc
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(caller, 3)
        await asyncio.sleep(0.1)
        assert env.started == ["s"]  # the start landed ...
        assert env.closes == ["s"] and table.open_sessions == 0, "... and nobody closed it in the environment"
        # a status code is acceptable; InvalidStateError (INTERNAL: a bug) is not
        assert error is None or isinstance(error, MeshError), f"Close failed with {error!r}"

    asyncio.run(go())


class SandboxPoolTool(BaseTool):
    """A tool whose constructor has a side effect (as verl's SandboxFusion tool starts a pool)."""

    constructed: list[str] = []

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        super().__init__(config, tool_schema)
        SandboxPoolTool.constructed.append(self.name)


class SchemaFromClassTool(BaseTool):
    """A tool that gives its schema itself (none in the YAML): reading it takes constructing it."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({"function": {"name": "own", "description": "from the class"}})


def test_prompt_tools_reads_the_yaml_schemas_without_constructing_the_tools(tmp_path: Path) -> None:
    """data.filter_overlong_prompts counts the tool schemas in the coordinator, the trainer, the
    `meshrl train` driver and `meshrl plan`, none of which runs a tool: a tool whose constructor
    starts a sandbox pool or opens connections must not be built there just to read a schema the
    YAML already gives. A tool without one in the YAML is still constructed for it."""
    from services.common.config import load_config
    from services.environment.factory import prompt_tools

    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n  - class_name: tests.unit.test_environment.SandboxPoolTool\n    config: {type: native}\n"
        "    tool_schema: {type: function, function: {name: run_code, description: Run code}}\n"
        "  - class_name: tests.unit.test_environment.SchemaFromClassTool\n"
    )
    cfg = load_config(None, ["data.train_files=[x.jsonl]", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                             "data.filter_overlong_prompts=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
                             f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}"])
    SandboxPoolTool.constructed.clear()
    schemas = prompt_tools(cfg)
    assert schemas is not None
    assert SandboxPoolTool.constructed == []
    expected = tuple(t.tool_schema.model_dump(exclude_none=True) for t in load_tools(str(path)))
    assert schemas("any") == expected
    assert [s["function"]["name"] for s in expected] == ["run_code", "own"]
