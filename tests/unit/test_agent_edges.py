"""Multi-turn edges: a sample's own first prompt that would fill its response budget, a tool
instance created while its sample is cancelled, the template-delta probe that must not change
how the history renders (Qwen3 reads a user message's content), and environment tokens that
would pass the engine's context length."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.common.errors import FailedPrecondition, Unavailable
from services.common.tiny import build_tokenizer
from services.environment.base import Message, StartResult, StepResult
from services.environment.factory import EnvironmentRouter
from services.environment.tool_env import ToolEnvironment
from services.environment.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse
from services.rollout.agent.loop import AgentLoop, AgentSettings
from services.rollout.engines.base import SamplingSpec
from tests.unit.test_agent_loop import CALL, ScriptedEngine, ScriptedEnv, _prompt, _run


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer(tools=True)


def test_a_samples_own_prompt_remainder_never_exceeds_the_response_budget(tok: Any) -> None:
    """Samples the environment starts differently: each one's remainder after the common prefix is
    appended as environment tokens unconditionally, so a long remainder makes the response longer
    than max_tokens (data.max_response_length); the coordinator refuses such a response."""
    starts = [StartResult(messages=(Message("user", "A" + " word" * 80),)),
              StartResult(messages=(Message("user", "B" + " word" * 80),))]
    env = ScriptedEnv(done_at=0, starts=starts)
    with pytest.raises(FailedPrecondition, match=r"raise data\.max_response_length"):
        _run(tok, ScriptedEngine(tok, ["a<|im_end|>"]), env, SamplingSpec(n=2, max_tokens=30))
    assert env.open == set()  # every session closed


class SlowCreateTool(BaseTool):
    """A tool whose create does I/O (a sandbox, a container) after registering its instance."""

    live: set[str] = set()
    released: list[str] = []

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        assert instance_id is not None
        SlowCreateTool.live.add(instance_id)
        await asyncio.sleep(0.2)
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[str, float, dict]:
        return "ok", 0.0, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        SlowCreateTool.released.append(instance_id)
        SlowCreateTool.live.discard(instance_id)


class FailSampleZero(ToolEnvironment):
    async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Any, *, policy_version: int = 0) -> StepResult:
        if session_id.endswith("/0"):
            await asyncio.sleep(0.05)
            raise Unavailable("environment endpoint 'x' has been failing")
        return await super().step(session_id, turn, assistant_text, tool_calls, policy_version=policy_version)


def test_a_tool_instance_created_while_the_group_is_cancelled_is_released(tok: Any) -> None:
    """Sample 1 is inside its tool's create when sibling sample 0 fails: run_group cancels it and
    closes its session, but the instance the tool created was never recorded, so it was never
    released (leaked for the life of the replica). It is released when the create lands."""
    schema = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}})
    env = FailSampleZero([SlowCreateTool(config={}, tool_schema=schema)])
    loop = AgentLoop(tok, EnvironmentRouter(env, []), AgentSettings())
    engine = ScriptedEngine(tok, [CALL + "<|im_end|>"])

    async def go() -> None:  # one event loop, as a rollout replica's: the create lands after the group failed
        with pytest.raises(Unavailable):
            await loop.run_group(_prompt(), SamplingSpec(n=2, max_tokens=200), "r/L1", engine.generate,
                                 lambda: False, lambda: 0)
        await asyncio.sleep(0.4)

    asyncio.run(go())
    assert env.status()["open_sessions"] == 0
    assert SlowCreateTool.live == set() and SlowCreateTool.released == ["r/L1/1/add"], SlowCreateTool.released


def test_the_fallback_probe_does_not_change_how_the_history_renders() -> None:
    """Qwen3's template treats a user message wrapped in <tool_response>...</tool_response> as a tool
    result (not a new query). The fallback replaces the first new message's content by a probe,
    which turns it into a query: the earlier thinking turn then renders without its <think> block
    in the probed text only, the prefixes differ, and a well-defined delta raises
    FailedPrecondition (the group fails; every such group of the run fails)."""
    from services.rollout.agent.chat import ChatRenderer
    from tests.unit.agent_fixtures.qwen3_template import qwen3_tokenizer

    r = ChatRenderer(qwen3_tokenizer())
    hist = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nR\n</think>\n\n<tool_call>{}</tool_call>"},
            {"role": "tool", "content": "T"}]
    a = {"role": "assistant", "content": "A"}
    new = [{"role": "user", "content": "<tool_response>x</tool_response>"}]
    text = r.env_text(hist, a, new, "<|im_end|>")
    full = r.render([*hist, a, *new], add_generation_prompt=True)
    assert text == "\n<|im_start|>user\n<tool_response>x</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert full.endswith(text[1:])


def test_environment_tokens_past_the_context_length_end_the_trajectory_with_length(tok: Any, model: Any) -> None:
    """rollout.max_model_len below prompt + response length (allowed). A single-turn sample ends
    with `length` at the context limit; a multi-turn one appended environment tokens without
    checking the context, and the next turn's generate() raised InvalidArgument, which the worker
    takes for bad input: it stopped the replica."""
    from services.rollout.engines.transformers_engine import TransformersEngine

    text = tok.apply_chat_template([{"role": "user", "content": "123+456="}], add_generation_prompt=True, tokenize=False)
    limit = len(tok.encode(text, add_special_tokens=False)) + 12
    loop = AgentLoop(tok, EnvironmentRouter(ScriptedEnv(done_at=50), []), AgentSettings(max_model_len=limit))
    # every printable character is a stop string: each assistant turn ends after a token or two
    spec = SamplingSpec(n=1, max_tokens=200, temperature=1.0, seed=0, stop=tuple(chr(c) for c in range(33, 127)))

    async def go() -> Any:
        engine = TransformersEngine(model, tok, max_model_len=limit)
        await engine.start()
        try:
            return await loop.run_group(_prompt(), spec, "r/L1", engine.generate, lambda: False, lambda: engine.version)
        finally:
            await engine.close()

    _, (t,) = asyncio.run(go())
    assert t.finish_reason.value == "length" and t.num_turns >= 1
