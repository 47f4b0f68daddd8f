"""One sampled turn must never take a rollout replica out (the worker stops a replica on
InvalidArgument, its own bad input): a chat template that rewrites history (Qwen3's thinking
turns), an environment that refuses a turn or rewards NaN, and a close cut half-way when a sibling
sample fails (the session would leak)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from meshrl.v1 import common_pb2
from services.common.errors import BadReply, FailedPrecondition, InvalidArgument, Unavailable
from services.common.tiny import build_tokenizer
from services.environment.base import CloseResult, EnvPrompt, StartResult, StepResult, ToolCall
from services.environment.factory import EnvironmentRouter
from services.environment.tool_env import ToolEnvironment
from services.environment.tools import load_tools
from services.rollout.agent.chat import ChatRenderer
from services.rollout.agent.loop import AgentLoop, AgentSettings
from services.rollout.engines.base import SamplingSpec
from tests.unit.agent_fixtures.qwen3_template import qwen3_tokenizer
from tests.unit.test_agent_loop import (
    CALL,
    TOOLS,
    RewritingTemplateTokenizer,
    ScriptedEngine,
    ScriptedEnv,
    _prompt,
    _run,
)


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer(tools=True)


# ---- chat deltas of templates that rewrite history ---------------------------------------------------


def test_qwen3_thinking_turns_get_the_template_delta_without_their_rewritten_content() -> None:
    """Qwen3's template drops an earlier turn's <think> block (a non-empty one once a user query
    follows, an empty one once anything follows), so neither the rendering so far nor the turn's
    content as the policy wrote it is in the new rendering: the delta is found by probing where the
    next message starts. Before, this raised InvalidArgument, which stops a rollout replica."""
    r = ChatRenderer(qwen3_tokenizer())
    hist = [{"role": "user", "content": "q"}]
    think = {"role": "assistant", "content": "<think>\nlet me add\n</think>\n\n579"}
    text = r.env_text(hist, think, [{"role": "user", "content": "sure?"}], "<|im_end|>")
    assert text == "\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n"
    empty = {"role": "assistant", "content": '<think>\n\n</think>\n\n<tool_call>{"name": "add"}</tool_call>'}
    tools = [{"role": "tool", "content": "579"}, {"role": "tool", "content": "1"}]
    text = r.env_text(hist, empty, tools, "<|im_end|>")
    assert text == ("\n<|im_start|>user\n<tool_response>\n579\n</tool_response>\n<tool_response>\n1\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert r.delta_fallbacks == 2
    assert r.tail("9") + text[1:] == r.env_text(hist, empty, tools, "9")  # a turn cut short gets the whole suffix


class PlainSuffixTokenizer(RewritingTemplateTokenizer):
    """Turns end with a bare newline, which also ends each header ("### user\n"), and the last
    assistant turn carries a <think></think> prefix that later renderings drop."""

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None, add_generation_prompt: bool = False,
                            tokenize: bool = False) -> str:
        out = ""
        for i, m in enumerate(messages):
            think = "<think></think>" if m["role"] == "assistant" and i == len(messages) - 1 else ""
            out += f"### {m['role']}\n{think}{m['content']}\n"
        return out + ("### assistant\n" if add_generation_prompt else "")


def test_the_fallback_delta_keeps_the_next_header_when_the_suffix_is_a_bare_newline() -> None:
    """The turn's end is found as suffix + the next message's header, not as the last suffix before
    it: here the last newline before the new message ends its header, and the delta would lose it."""
    r = ChatRenderer(PlainSuffixTokenizer())
    assert r.assistant_suffix == "\n"
    text = r.env_text([{"role": "user", "content": "q"}], {"role": "assistant", "content": "a"},
                      [{"role": "user", "content": "more"}], "a")
    assert text == "\n### user\nmore\n### assistant\n" and r.delta_fallbacks == 1


def test_a_template_whose_turn_end_cannot_be_found_fails_the_group_not_the_replica() -> None:
    """No recognisable suffix: FailedPrecondition (the group fails; the coordinator halts the run on
    a series of them), never InvalidArgument (the worker stops the replica on that)."""

    class NoSuffix(RewritingTemplateTokenizer):
        def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None,
                                add_generation_prompt: bool = False, tokenize: bool = False) -> str:
            last = len(messages) - 1
            return "".join(("<think></think>" if m["role"] == "assistant" and i == last else "") + m["content"]
                           for i, m in enumerate(messages))

    r = ChatRenderer(NoSuffix())
    with pytest.raises(FailedPrecondition, match=r"multi_turn\.enable=false"):
        r.env_text([{"role": "user", "content": "q"}], {"role": "assistant", "content": "a"},
                   [{"role": "user", "content": "more"}], "a")


# ---- whole trajectories ---------------------------------------------------------------------------


def test_a_qwen3_thinking_trajectory_keeps_the_sampled_ids_and_appends_the_template_delta() -> None:
    """Token-in/token-out through the fallback: each turn continues from exactly the ids so far,
    the policy's ids are as sampled (think block included), the environment's are the delta."""
    tok = qwen3_tokenizer()
    first = "<think>\n\n</think>\n\n" + CALL + "<|im_end|>"
    engine = ScriptedEngine(tok, [first, "<think>\nok\n</think>\n\n579<|im_end|>"])
    prompt_ids, (t,) = _run(tok, engine, ToolEnvironment(load_tools(TOOLS)), SamplingSpec(n=1, max_tokens=400))
    call_ids = tok.encode(first, add_special_tokens=False)
    env_ids = tok.encode("\n<|im_start|>user\n<tool_response>\n579\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                         add_special_tokens=False)
    assert t.token_ids[: len(call_ids) + len(env_ids)] == call_ids + env_ids
    assert t.loss_mask[: len(call_ids) + len(env_ids)] == [1] * len(call_ids) + [0] * len(env_ids)
    assert engine.requests[1].prompt_token_ids == prompt_ids + call_ids + env_ids
    assert (t.num_turns, t.tool_errors, t.final_text) == (2, 0, "<think>\nok\n</think>\n\n579")


class SlowCloseEnv(ScriptedEnv):
    """Sample 0's step fails after a moment; sample 1 is done at once and its close takes longer
    (a tool's calc_reward / release doing I/O)."""

    async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *,
                   policy_version: int = 0) -> StepResult:
        if session_id.endswith("/0"):
            await asyncio.sleep(0.05)
            raise Unavailable("environment endpoint 'x' has been failing")
        return StepResult(done=True)

    async def close(self, session_id: str) -> CloseResult:
        if session_id.endswith("/1"):
            await asyncio.sleep(0.3)
        return await super().close(session_id)


def test_a_close_under_way_when_a_sibling_fails_runs_to_its_end(tok: Any) -> None:
    """run_group cancels the other samples when one fails; a sample inside its close must not have
    the close cut half-way (the session would leak: in-process, its tool instances are never
    released), and run_group raises only once every session is closed."""
    env = SlowCloseEnv()
    with pytest.raises(Unavailable):
        _run(tok, ScriptedEngine(tok, ["a<|im_end|>"]), env, SamplingSpec(n=2, max_tokens=50))
    assert env.open == set()


class RefusingEnv(ScriptedEnv):
    """An environment that refuses a turn (a remote one's INVALID_ARGUMENT) or rewards NaN."""

    def __init__(self, refuse: str = "", reward: float | None = None) -> None:
        super().__init__(done_at=0)
        self.refuse, self.reward = refuse, reward

    async def start(self, session_id: str, prompt: EnvPrompt, *, sample_index: int = 0, policy_version: int = 0) -> StartResult:
        if self.refuse == "start":
            raise InvalidArgument("prompt.extra_info_json.tools_kwargs", "must be an object")
        return await super().start(session_id, prompt, sample_index=sample_index, policy_version=policy_version)

    async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *,
                   policy_version: int = 0) -> StepResult:
        if self.refuse == "step":
            raise InvalidArgument("tool_calls", "65 calls exceed environment.max_tool_calls=64")
        return StepResult(done=True, reward=self.reward)


@pytest.mark.parametrize("env", [RefusingEnv(refuse="start"), RefusingEnv(refuse="step"), RefusingEnv(reward=float("nan"))],
                         ids=["start refused", "step refused", "nan reward"])
def test_an_environment_refusal_or_a_non_finite_reward_fails_the_group_as_bad_reply(tok: Any, env: RefusingEnv) -> None:
    """Not InvalidArgument: the worker takes that for its own bad input and stops the replica."""
    with pytest.raises(BadReply) as err:
        _run(tok, ScriptedEngine(tok, ["a<|im_end|>"]), env, SamplingSpec(n=2, max_tokens=50))
    assert not isinstance(err.value, InvalidArgument) and err.value.source == "environment 'environment'"
    assert env.open == set()


# ---- in the worker ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["qwen3 thinking turn", "environment refuses a turn"])
def test_one_bad_sampled_turn_fails_its_group_and_the_replica_goes_on(case: str) -> None:
    """Two ways one sampled turn used to stop a whole replica (InvalidArgument): a Qwen3 thinking
    turn followed by a user turn, and an environment that refuses a turn. The first now plays;
    the second fails its group (lease returned, counted) and the replica keeps leasing."""
    from services.rollout.worker import RolloutWorker, WorkerSettings
    from tests.rollout_helpers import FakeCoordinator, length_scorer, wait_for

    if case == "qwen3 thinking turn":
        tok = qwen3_tokenizer()
        env: ScriptedEnv = ScriptedEnv(done_at=1, reply="are you sure?")
        turns = ["<think>\nadd them\n</think>\n\n579<|im_end|>", "yes, 579<|im_end|>"]
    else:
        tok = build_tokenizer(tools=True)
        env = RefusingEnv(refuse="step")
        turns = ["579<|im_end|>"]
    coord = FakeCoordinator([_prompt(), _prompt()], common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=256))
    agent = AgentLoop(tok, EnvironmentRouter(env, []), AgentSettings())

    async def go() -> None:
        worker = RolloutWorker(ScriptedEngine(tok, turns), tok, coord, length_scorer, None,
                               WorkerSettings(replica_id="w", concurrent_groups=1, idle_poll_s=0.05), agent=agent)
        worker._synced = True
        worker.start()
        try:
            if case == "qwen3 thinking turn":
                await wait_for(lambda: len(coord.submitted) >= 2 or not worker.healthy, what="both groups submitted")
            else:
                await wait_for(lambda: len(coord.returned) >= 3 or not worker.healthy, what="leases returned")
            assert worker.healthy, f"replica stopped: {worker.last_error}"
        finally:
            await worker.stop()

    asyncio.run(go())
    assert env.open == set()
