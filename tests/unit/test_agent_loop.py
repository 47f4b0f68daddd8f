"""The agent loop without a network: the hermes parser, truncation, chat-template deltas, and whole
trajectories against a scripted policy (a hand-written engine that answers each request with the
next scripted turn) and real environments (the calculator tool, scripted ones): token continuity,
the mask, limits, failures, rewards, what the reward service is asked to score."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from meshrl.v1 import common_pb2, coordinator_pb2
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.common.tiny import build_tokenizer
from services.coordinator.convert import groups_from_request
from services.environment.base import CloseResult, Environment, EnvPrompt, Message, StartResult, StepResult, ToolCall
from services.environment.factory import EnvironmentRouter
from services.environment.tool_env import ToolEnvironment
from services.environment.tools import load_tools
from services.rollout import convert
from services.rollout.agent.chat import ChatRenderer
from services.rollout.agent.group import apply_reward_source
from services.rollout.agent.loop import AgentLoop, AgentSettings, truncate_text
from services.rollout.agent.parser import parse_tool_calls
from services.rollout.engines.base import (
    EngineHealth,
    Finish,
    GenerationRequest,
    PauseMode,
    RolloutEngine,
    SampleOutput,
    SamplingSpec,
)
from services.weights.protocols import Buckets

ROOT = Path(__file__).resolve().parents[2]
TOOLS = str(ROOT / "configs" / "examples" / "tool_add_tools.yaml")
CALL = '<tool_call>{"name":"add","arguments":{"a":123,"b":456}}</tool_call>'


# ---- the parser ---------------------------------------------------------------------------------------


def test_parser_reads_hermes_calls_and_names_what_is_wrong() -> None:
    text = ('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call> then <tool_call>{"name"')
    content, calls = parse_tool_calls(text, turn=2)
    assert content == "I will add.  then"
    assert [c.id for c in calls] == [f"call_2_{i}" for i in range(7)]
    assert (calls[0].name, calls[0].arguments(), calls[0].parse_error) == ("add", {"a": 1, "b": 2}, "")
    assert calls[1].arguments() == {"a": 3, "b": 4} and not calls[1].parse_error
    assert "invalid JSON" in calls[2].parse_error
    assert "name" in calls[3].parse_error
    assert "JSON object" in calls[4].parse_error
    assert '"arguments" must be an object' in calls[5].parse_error
    assert "without </tool_call>" in calls[6].parse_error
    assert parse_tool_calls("just 579", 0) == ("just 579", [])


def test_parser_never_raises_on_json_python_cannot_read() -> None:
    """Model output is arbitrary: nesting past the interpreter's depth (RecursionError) and an
    integer past Python's digit limit (ValueError) are parse errors, in the block and in a string of
    arguments, like any malformed JSON."""
    deep = "[" * 100_000 + "]" * 100_000
    huge = "9" * 5000
    text = (f'<tool_call>{deep}</tool_call><tool_call>{{"name": "add", "arguments": {{"a": {huge}}}}}</tool_call>'
            f'<tool_call>{{"name": "add", "arguments": {json.dumps(deep)}}}</tool_call>'
            f'<tool_call>{{"name": "add", "arguments": "{{\\"a\\": {huge}}}"}}</tool_call>{CALL}')
    content, calls = parse_tool_calls(text, turn=0)
    assert content == "" and len(calls) == 5
    assert "invalid JSON" in calls[0].parse_error and "invalid JSON" in calls[1].parse_error
    assert "arguments are not valid JSON" in calls[2].parse_error and calls[2].name == "add"
    assert "arguments are not valid JSON" in calls[3].parse_error
    assert calls[4].arguments() == {"a": 123, "b": 456} and not calls[4].parse_error


def test_a_tool_name_no_tool_could_have_is_a_parse_error() -> None:
    """A sampled name past MAX_NAME_CHARS is answered as a malformed call, not sent: an environment
    server refuses a whole Step whose call names pass security.limits.max_name_chars."""
    from services.rollout.agent.parser import MAX_NAME_CHARS

    ok = "n" * MAX_NAME_CHARS
    _, calls = parse_tool_calls(f'<tool_call>{{"name": "{ok}n", "arguments": {{}}}}</tool_call>'
                                f'<tool_call>{{"name": "{ok}", "arguments": {{}}}}</tool_call>')
    assert calls[0].name == "" and f"at most {MAX_NAME_CHARS}" in calls[0].parse_error
    assert calls[1].name == ok and not calls[1].parse_error


@pytest.mark.parametrize(("side", "expected"), [
    ("left", "abcde...(truncated)"), ("right", "(truncated)...vwxyz"), ("middle", "ab...(truncated)...yz"),
])
def test_truncation_keeps_the_configured_side(side: Any, expected: str) -> None:
    text = "abcdefghijklmnopqrstuvwxyz"
    assert truncate_text(text, 5, side) == (expected, True)
    assert truncate_text("short", 5, side) == ("short", False)


def test_a_middle_cut_keeps_what_verl_keeps() -> None:
    """verl's ToolAgentLoop keeps limit // 2 characters of each end (2 * (limit // 2) in all, one
    fewer than the limit when it is odd); a config ported from verl shows the policy the same text."""
    text = "abcdefghijklmnopqrstuvwxyz"
    for limit in (2, 5, 6, 9):
        half = limit // 2
        assert truncate_text(text, limit, "middle") == (text[:half] + "...(truncated)..." + text[-half:], True)
    assert truncate_text(text, 1, "middle") == ("...(truncated)...", True)  # nothing of either end, not the whole text


# ---- chat deltas ------------------------------------------------------------------------------------


class RewritingTemplateTokenizer:
    """A tokenizer whose template drops an assistant message's `<think></think>` prefix once a later
    message follows (what Qwen3's template does): base is not a prefix of new."""

    def __init__(self) -> None:
        self.inner = build_tokenizer(tools=True)
        self.chat_template = "custom"

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None, add_generation_prompt: bool = False,
                            tokenize: bool = False) -> str:
        out = ""
        for i, m in enumerate(messages):
            think = "<think></think>" if m["role"] == "assistant" and i == len(messages) - 1 else ""
            out += f"<|im_start|>{m['role']}\n{think}{m['content']}<|im_end|>\n"
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens))


def test_delta_falls_back_when_the_template_rewrites_history() -> None:
    r = ChatRenderer(RewritingTemplateTokenizer())
    hist = [{"role": "user", "content": "q"}]
    text = r.env_text(hist, {"role": "assistant", "content": "a"}, [{"role": "user", "content": "more"}], "<|im_end|>")
    assert text == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    assert r.delta_fallbacks == 1


def test_a_turn_without_its_end_token_gets_the_whole_suffix() -> None:
    r = ChatRenderer(build_tokenizer(tools=True))
    assert r.tail("<|im_end|>") == "\n" and r.tail("9") == "<|im_end|>\n"


def test_a_turn_ending_in_a_plain_token_that_begins_the_suffix_text_still_gets_the_whole_suffix() -> None:
    """A turn cut (length) right after a plain `<` did not write the end-of-turn token, though `<`
    begins the suffix's text: the env tokens must start with `<|im_end|>` itself, not the
    characters `|im_end|>` (a context no template renders; the trainer would score it)."""
    tok = build_tokenizer(tools=True)
    r = ChatRenderer(tok)
    assert r.tail("<") == "<|im_end|>\n" and r.tail("<|im_end|>") == "\n"
    ids = r.env_ids([{"role": "user", "content": "q"}], {"role": "assistant", "content": "a<"},
                    [{"role": "user", "content": "go"}], "<")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_end|>")


# ---- whole trajectories with a scripted policy ---------------------------------------------------------


class ScriptedEngine(RolloutEngine):
    """Answers request k of a sample with its k-th scripted turn (logprob -0.1 per token, version
    `version`); records every request. `chop` cuts turn texts into an aborted first part."""

    name = "scripted"

    def __init__(self, tok: Any, turns: Sequence[str], *, abort_first: bool = False) -> None:
        self.tok = tok
        self.turns = [list(tok.encode(t, add_special_tokens=False)) for t in turns]
        self.requests: list[GenerationRequest] = []
        self._next: dict[str, int] = {}
        self._version = 0
        self.abort_first = abort_first

    async def start(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> list[SampleOutput]:
        self.requests.append(request)
        sample = request.request_id.split("/t")[0]
        if self.abort_first and "/r" not in request.request_id and request.request_id.endswith("/t0"):
            ids = self.turns[0][:5]  # cut by a weight update after 5 tokens
            self._version += 1
            return [SampleOutput(0, list(ids), [-0.1] * len(ids), [self._version - 1] * len(ids), Finish.ABORT)]
        k = self._next.get(sample, 0)
        ids = self.turns[min(k, len(self.turns) - 1)]
        if self.abort_first and k == 0:
            ids = ids[5:]
        self._next[sample] = k + 1
        ids = ids[: request.sampling.max_tokens]
        finish = Finish.STOP if len(ids) < request.sampling.max_tokens or ids[-1] == self.tok.eos_token_id else Finish.LENGTH
        return [SampleOutput(0, list(ids), [-0.1] * len(ids), [self._version] * len(ids), finish)]

    async def abort(self, request_id: str) -> bool:
        return False

    async def abort_all(self) -> dict[str, list[SampleOutput]]:
        return {}

    async def pause(self, mode: PauseMode = "keep") -> None:
        return None

    async def resume(self) -> None:
        return None

    @property
    def paused(self) -> bool:
        return False

    async def load_weights(self, version: int, buckets: Buckets) -> int:
        return 0

    @property
    def version(self) -> int:
        return self._version

    async def health(self) -> EngineHealth:
        return EngineHealth(True)

    def stats(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None


class ScriptedEnv(Environment):
    """Answers every turn with one message of `role` (a user turn, as an interaction's), done at
    `done_at`; may fail its step."""

    def __init__(self, done_at: int = 1, reply: str = "next", fail: bool = False, starts: Sequence[StartResult] = (),
                 role: str = "user") -> None:
        self.done_at, self.reply, self.fail, self.role = done_at, reply, fail, role
        self.starts = list(starts)
        self.open: set[str] = set()
        self.steps = 0

    async def start(self, session_id: str, prompt: EnvPrompt, *, sample_index: int = 0, policy_version: int = 0) -> StartResult:
        self.open.add(session_id)
        return self.starts[sample_index] if self.starts else StartResult()

    async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *,
                   policy_version: int = 0) -> StepResult:
        self.steps += 1
        if self.fail:
            raise Unavailable("environment endpoint 'x' has been failing for 60s")
        return StepResult(messages=(Message(self.role, self.reply),), done=turn >= self.done_at, reward=1.0 if turn >= self.done_at else None)

    async def close(self, session_id: str) -> CloseResult:
        self.open.discard(session_id)
        return CloseResult(reward=0.5, metrics={"closed": 1.0})


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer(tools=True)


def _prompt(text: str = "123+456=") -> common_pb2.Prompt:
    p = common_pb2.Prompt(prompt_seq=3, prompt_id="train:3", data_source="meshrl/tool_add", ground_truth="579")
    p.messages.add(role="user", content=text)
    return p


def _run(tok: Any, engine: RolloutEngine, env: Environment, spec: SamplingSpec, **settings: Any) -> tuple[list[int], list[Any]]:
    loop = AgentLoop(tok, EnvironmentRouter(env, []), AgentSettings(**settings))

    async def go() -> tuple[list[int], list[Any]]:
        return await loop.run_group(_prompt(), spec, "r/L1", engine.generate, lambda: False, lambda: engine.version)

    return asyncio.run(go())


def test_tool_call_trajectory_is_exact_ids_with_a_mask(tok: Any) -> None:
    engine = ScriptedEngine(tok, [CALL + "<|im_end|>", "579<|im_end|>"])
    env = ToolEnvironment(load_tools(TOOLS))
    prompt_ids, (t,) = _run(tok, engine, env, SamplingSpec(n=1, max_tokens=120))
    call_ids = tok.encode(CALL + "<|im_end|>", add_special_tokens=False)
    env_text = "\n<|im_start|>user\n<tool_response>\n579\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    env_ids = tok.encode(env_text, add_special_tokens=False)
    answer = tok.encode("579<|im_end|>", add_special_tokens=False)
    assert prompt_ids == tok.encode("<|im_start|>user\n123+456=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert t.token_ids == call_ids + env_ids + answer
    assert t.loss_mask == [1] * len(call_ids) + [0] * len(env_ids) + [1] * len(answer)
    assert t.turn_starts == [0, len(call_ids), len(call_ids) + len(env_ids)]
    assert t.versions == [0] * len(call_ids) + [-1] * len(env_ids) + [0] * len(answer)
    assert t.logprobs[len(call_ids)] == 0.0 and t.logprobs[0] == -0.1
    # Token-in/token-out: each turn continued from exactly the ids so far.
    assert [r.prompt_token_ids for r in engine.requests] == [prompt_ids, prompt_ids + call_ids + env_ids]
    assert (t.final_text, t.num_turns, t.tool_calls, t.tool_errors, t.finish_reason) == ("579", 2, 1, 0, Finish.STOP)
    assert t.env_reward == 0.0 and t.env_metrics["env_latency_s"] >= 0


def test_malformed_call_is_answered_and_counted_and_the_episode_goes_on(tok: Any) -> None:
    engine = ScriptedEngine(tok, ['<tool_call>{"name":"add","arguments":{"a":1</tool_call><|im_end|>', "3<|im_end|>"])
    loop = AgentLoop(tok, EnvironmentRouter(ToolEnvironment(load_tools(TOOLS)), []), AgentSettings())

    async def go() -> Any:
        return await loop.run_group(_prompt(), SamplingSpec(n=2, max_tokens=200), "r/L2", engine.generate, lambda: False, lambda: 0)

    _, trajectories = asyncio.run(go())
    for t in trajectories:
        assert (t.tool_calls, t.tool_errors, t.num_turns, t.final_text) == (1, 1, 2, "3")
        env = tok.decode([x for x, m in zip(t.token_ids, t.loss_mask, strict=True) if not m])
        assert "could not be parsed: invalid JSON" in env
    assert loop.counters.tool_errors == 2 and loop.counters.tokenization_drift == 0


def test_long_messages_are_truncated_and_the_budget_is_kept(tok: Any) -> None:
    engine = ScriptedEngine(tok, ["hi<|im_end|>"])
    _, (t,) = _run(tok, engine, ScriptedEnv(done_at=9, reply="x" * 500, role="tool"), SamplingSpec(n=1, max_tokens=60),
                   max_tool_response_length=10, tool_response_truncate_side="left")
    env = tok.decode([x for x, m in zip(t.token_ids, t.loss_mask, strict=True) if not m])
    assert "xxxxxxxxxx...(truncated)" in env and "x" * 11 not in env
    assert t.env_metrics["truncated_messages"] >= 1
    # The environment tokens that would cross the budget are not appended: length, within budget.
    assert len(t) <= 60 and t.finish_reason == Finish.LENGTH


def test_user_turns_are_not_cut_to_the_tool_response_length(tok: Any) -> None:
    """verl cuts only tool responses to multi_turn.max_tool_response_length; an interaction's user
    turn reaches the policy whole (bounded by the response budget like any environment tokens)."""
    engine = ScriptedEngine(tok, ["hi<|im_end|>"])
    reply = "please think again about " + "y" * 40
    _, (t,) = _run(tok, engine, ScriptedEnv(done_at=1, reply=reply), SamplingSpec(n=1, max_tokens=400),
                   max_tool_response_length=10)
    env = tok.decode([x for x, m in zip(t.token_ids, t.loss_mask, strict=True) if not m])
    assert reply in env and "(truncated)" not in env
    assert "truncated_messages" not in t.env_metrics


def test_tool_errors_are_not_cut_to_the_tool_response_length(tok: Any) -> None:
    """verl answers a call it could not run (unknown tool, bad arguments, a tool that raised) with
    its error text whole; only a tool's own response is cut to max_tool_response_length."""
    calls = ('<tool_call>{"name":"mul","arguments":{"a":1,"b":2}}</tool_call>'
             '<tool_call>{"name":"add","arguments":{"a":1,"c":2}}</tool_call><|im_end|>')
    engine = ScriptedEngine(tok, [calls, "3<|im_end|>"])
    _, (t,) = _run(tok, engine, ToolEnvironment(load_tools(TOOLS), max_parallel_calls=2), SamplingSpec(n=1, max_tokens=400),
                   max_tool_response_length=10)
    env = tok.decode([x for x, m in zip(t.token_ids, t.loss_mask, strict=True) if not m])
    assert "Error: unknown tool 'mul'; available tools: ['add']" in env
    assert "Error when executing tool add: add takes exactly the arguments a and b, got ['a', 'c']" in env
    assert "(truncated)" not in env and "truncated_messages" not in t.env_metrics
    assert (t.tool_calls, t.tool_errors, t.final_text) == (2, 2, "3")


def test_the_message_that_ends_the_episode_is_appended_masked_within_the_budget(tok: Any) -> None:
    """verl appends an interaction's last user message (loss mask 0) before it stops on its
    terminate; the response (its length, what DAPO's overlong shaping counts) ends with it. Past the
    response budget it is cut there, as verl cuts its response; the episode still ended `stop`."""
    def run(budget: int) -> tuple[Any, AgentLoop]:
        engine = ScriptedEngine(tok, ["a<|im_end|>", "b<|im_end|>"])
        loop = AgentLoop(tok, EnvironmentRouter(ScriptedEnv(done_at=1, reply="well done"), []), AgentSettings())

        async def go() -> Any:
            return await loop.run_group(_prompt(), SamplingSpec(n=1, max_tokens=budget), "r/L1", engine.generate,
                                        lambda: False, lambda: 0)

        return asyncio.run(go())[1][0], loop

    t, loop = run(200)
    last = tok.encode("\n<|im_start|>user\nwell done<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert t.token_ids[-len(last):] == last and t.loss_mask[-len(last):] == [0] * len(last)
    assert t.versions[-1] == -1 and t.logprobs[-1] == 0.0 and t.turn_starts[-1] == len(t) - len(last)
    assert (t.final_text, t.num_turns, t.finish_reason, t.env_reward) == ("b", 2, Finish.STOP, 1.5)
    assert loop.counters.tokenization_drift == 0
    cut, loop = run(len(t) - 3)
    assert cut.token_ids == t.token_ids[:-3] and cut.loss_mask == t.loss_mask[:-3]
    assert cut.finish_reason == Finish.STOP and loop.counters.tokenization_drift == 0


def test_a_served_environments_tool_errors_are_not_cut_either(tok: Any) -> None:
    """The same error texts from `meshrl environment serve` (ToolEnvironment behind gRPC): the
    ChatMessage carries `error`, so they reach the policy whole as in process; they were cut to
    max_tool_response_length, the flag lost on the wire. A served answer past the server's
    max_message_chars is still cut there, error or not (test_environment_bounds)."""
    from services.environment.client import RemoteEnvironment
    from services.environment.config import EnvironmentConfig, EnvironmentEndpointConfig
    from services.environment.server import EnvironmentServer

    calls = ('<tool_call>{"name":"mul","arguments":{"a":1,"b":2}}</tool_call>'
             '<tool_call>{"name":"add","arguments":{"a":1,"c":2}}</tool_call>' + CALL + '<|im_end|>')
    engine = ScriptedEngine(tok, [calls, "3<|im_end|>"])

    async def go() -> Any:
        server = EnvironmentServer(ToolEnvironment(load_tools(TOOLS), max_parallel_calls=3), EnvironmentConfig(),
                                   host="127.0.0.1", port=0)
        await server.start()
        env = RemoteEnvironment(EnvironmentEndpointConfig(address=server.address))
        loop = AgentLoop(tok, EnvironmentRouter(env, []), AgentSettings(max_tool_response_length=10))
        try:
            return await loop.run_group(_prompt(), SamplingSpec(n=1, max_tokens=400), "r/L1", engine.generate,
                                        lambda: False, lambda: engine.version)
        finally:
            await env.aclose()
            await server.stop(None)

    _, (t,) = asyncio.run(go())
    env_text = tok.decode([x for x, m in zip(t.token_ids, t.loss_mask, strict=True) if not m])
    assert "Error: unknown tool 'mul'; available tools: ['add']" in env_text
    assert "Error when executing tool add: add takes exactly the arguments a and b, got ['a', 'c']" in env_text
    assert "579" in env_text and t.env_metrics.get("truncated_messages") is None
    assert (t.tool_calls, t.tool_errors, t.final_text) == (3, 2, "3")


@pytest.mark.parametrize("message", [Message("tool", "Error when executing tool add: " + "e" * (3 << 20), error=True),
                                     Message("user", "u" * (3 << 20))], ids=["tool-error", "user-turn"])
def test_a_message_kept_whole_is_still_bounded(tok: Any, message: Message, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error text (a tool that raised with a huge message) or an interaction's user turn is not
    cut to max_tool_response_length, but is cut (in the middle, counted) to
    environment.max_message_chars, the bound a served environment's answer has: whole, the rollout
    tokenized any size in its event loop (and again in the drift check) before the response budget
    dropped it."""
    seen: list[int] = []

    def spy(self: ChatRenderer, history: Any, assistant: Any, new: Sequence[dict[str, Any]], end: str) -> list[int]:
        seen.append(max(len(m["content"]) for m in new))
        return list(tok.encode("x", add_special_tokens=False))  # not tokenized: the length is the point

    class Once(ScriptedEnv):
        async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *,
                       policy_version: int = 0) -> StepResult:
            return StepResult(messages=(message,), done=True)

    monkeypatch.setattr(ChatRenderer, "env_ids", spy)
    _, (t,) = _run(tok, ScriptedEngine(tok, ["a<|im_end|>"]), Once(), SamplingSpec(n=1, max_tokens=50),
                   sanity_mode="disable")
    limit = 1 << 20  # environment.max_message_chars' default
    assert seen and seen[0] <= limit + len("...(truncated)..."), f"{seen[0]} characters reached the tokenizer"
    assert t.env_metrics["truncated_messages"] == 1


def test_environment_max_message_chars_reaches_the_agent_loop(tok: Any) -> None:
    from services.common.config import load_config
    from services.rollout.factory import build_agent, worker_settings

    cfg = load_config(None, ["environment.max_message_chars=4096", "actor_rollout_ref.rollout.multi_turn.enable=true"])
    assert build_agent(cfg, tok, worker_settings(cfg, None)).s.max_message_chars == 4096


def test_a_user_turn_past_the_budget_is_appended_cut_there_as_verl_does(tok: Any) -> None:
    """verl's ToolAgentLoop appends an interaction's user turn (loss mask 0) without a budget check
    and cuts its response at response_length at the end: a user turn that crosses the budget is in
    the response up to it (what DAPO's overlong shaping and the trainer see), and no turn follows.
    A tool response that would cross it is not appended (verl's tool branch), as before."""
    def run(budget: int, role: str = "user") -> tuple[Any, ScriptedEngine, AgentLoop]:
        engine = ScriptedEngine(tok, ["a<|im_end|>", "b<|im_end|>"])
        env = ScriptedEnv(done_at=1, reply="please think again about it", role=role)
        loop = AgentLoop(tok, EnvironmentRouter(env, []), AgentSettings())

        async def go() -> Any:
            return await loop.run_group(_prompt(), SamplingSpec(n=1, max_tokens=budget), "r/L1", engine.generate,
                                        lambda: False, lambda: 0)

        return asyncio.run(go())[1][0], engine, loop

    full, _, _ = run(200)
    first = full.turn_starts[2]  # the first assistant turn and the user turn after it
    for budget in (first - 3, first):
        t, engine, loop = run(budget)
        assert t.token_ids == full.token_ids[:budget] and t.loss_mask == full.loss_mask[:budget]
        assert t.versions[-1] == -1 and t.logprobs[-1] == 0.0 and t.turn_starts == full.turn_starts[:2]
        assert (len(t), t.finish_reason, t.num_turns, len(engine.requests)) == (budget, Finish.LENGTH, 1, 1)
        assert loop.counters.tokenization_drift == 0
    t, engine, _ = run(first - 3, role="tool")
    assert t.token_ids == full.token_ids[:full.turn_starts[1]] and t.finish_reason == Finish.LENGTH


def test_turn_limits_stop_without_asking_the_environment(tok: Any) -> None:
    env = ScriptedEnv(done_at=9)
    _, (t,) = _run(tok, ScriptedEngine(tok, ["a<|im_end|>"]), env, SamplingSpec(n=1, max_tokens=200), max_assistant_turns=1)
    assert t.num_turns == 1 and env.steps == 0 and t.env_reward == 0.5  # Close still rewards
    env = ScriptedEnv(done_at=9, starts=[StartResult(max_turns=2)])
    _, (t,) = _run(tok, ScriptedEngine(tok, ["a<|im_end|>"]), env, SamplingSpec(n=1, max_tokens=200))
    assert t.num_turns == 2 and env.steps == 1
    env = ScriptedEnv(done_at=9)
    _, (t,) = _run(tok, ScriptedEngine(tok, ["a<|im_end|>"]), env, SamplingSpec(n=1, max_tokens=200), max_user_turns=2)
    assert t.num_turns == 3 and env.steps == 2


def test_an_environment_failure_fails_the_group_and_closes_every_session(tok: Any) -> None:
    env = ScriptedEnv(fail=True)
    with pytest.raises(Unavailable, match="environment endpoint"):
        _run(tok, ScriptedEngine(tok, ["a<|im_end|>"]), env, SamplingSpec(n=3, max_tokens=50))
    assert env.open == set()


def test_a_session_the_environment_lost_before_its_close_fails_the_group(tok: Any) -> None:
    """The environment server restarted after the last Step: Close answers NotFound (its reward is
    unknown). The group fails (the worker gives its lease back) rather than train the trajectory
    without its close reward."""
    class LostOnClose(ScriptedEnv):
        async def close(self, session_id: str) -> CloseResult:
            self.open.discard(session_id)
            raise NotFound(f"no session {session_id!r} (lost in a restart of this server); its reward is unknown")

    env = LostOnClose(done_at=0)
    with pytest.raises(NotFound, match="reward is unknown"):
        _run(tok, ScriptedEngine(tok, ["579<|im_end|>"]), env, SamplingSpec(n=2, max_tokens=50))
    assert env.steps == 2 and env.open == set()


def test_a_group_that_fails_or_is_cancelled_before_its_turns_closes_every_started_session(tok: Any) -> None:
    """The sessions are started before the prompt is rendered and truncated: a prompt over
    max_prompt_length (truncation=error) or a cancelled group (drain, stop) must not leave them
    open (the in-process environment has no expiry)."""
    env = ScriptedEnv()
    with pytest.raises(InvalidArgument, match="max_prompt_length"):
        _run(tok, ScriptedEngine(tok, ["a<|im_end|>"]), env, SamplingSpec(n=4, max_tokens=50), max_prompt_length=3)
    assert env.open == set()

    class SlowStarts(ScriptedEnv):
        async def start(self, session_id: str, prompt: EnvPrompt, *, sample_index: int = 0, policy_version: int = 0) -> StartResult:
            self.open.add(session_id)
            if sample_index == 3:
                await asyncio.sleep(30)
            return StartResult()

    slow = SlowStarts()
    loop = AgentLoop(tok, EnvironmentRouter(slow, []), AgentSettings())

    async def cancelled_while_starting() -> None:
        engine = ScriptedEngine(tok, ["a<|im_end|>"])
        group = asyncio.ensure_future(loop.run_group(_prompt(), SamplingSpec(n=4, max_tokens=50), "r/L2", engine.generate,
                                                     lambda: False, lambda: 0))
        await asyncio.sleep(0.05)
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await group

    asyncio.run(cancelled_while_starting())
    assert slow.open == set()


def test_aborted_turn_continues_from_its_partial_tokens(tok: Any) -> None:
    engine = ScriptedEngine(tok, [CALL + "<|im_end|>", "579<|im_end|>"], abort_first=True)
    _, (t,) = _run(tok, engine, ToolEnvironment(load_tools(TOOLS)), SamplingSpec(n=1, max_tokens=120))
    first = engine.requests[0].prompt_token_ids
    assert engine.requests[1].prompt_token_ids == first + t.token_ids[:5]  # continued after the abort
    call_len = len(tok.encode(CALL + "<|im_end|>", add_special_tokens=False))
    assert t.versions[:5] == [0] * 5 and set(t.versions[5:call_len]) == {1}
    assert t.num_resumes == 1 and t.final_text == "579" and t.tool_errors == 0


def test_a_stop_string_across_the_cut_of_an_aborted_turn_ends_the_turn_there(tok: Any) -> None:
    """The engine that continues a cut turn sees only the continuation's text: a stop string that
    began before the cut and completes after it went unseen, and the turn ran on past it (the
    single-turn worker already cut there; the agent loop and the gateway did not)."""
    turn = "zebra quokka narwhal wombat<|im_end|>"
    ids = tok.encode(turn, add_special_tokens=False)
    before, after = tok.decode(ids[:5]), tok.decode(ids[:6])
    assert len(after) > len(before) >= 2, (before, after)
    stop = before[-2:] + after[len(before)]  # starts in the aborted part, completes in the first new token
    assert turn.count(stop) == 1
    engine = ScriptedEngine(tok, [turn], abort_first=True)
    _, (t,) = _run(tok, engine, ScriptedEnv(done_at=0), SamplingSpec(n=1, max_tokens=120, stop=(stop,)))
    assert engine.requests[1].prompt_token_ids == engine.requests[0].prompt_token_ids + ids[:5]
    policy = [x for x, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
    assert policy == ids[:6], tok.decode(policy)  # through the token that completes the stop string
    assert t.finish_reason == "stop" and t.policy_versions() == [0] * 5 + [1]  # then the done message (verl)


def test_samples_started_differently_share_the_common_prefix(tok: Any) -> None:
    starts = [StartResult(messages=(Message("user", "123+456="),)), StartResult(messages=(Message("user", "123+457="),))]
    prompt_ids, (a, b) = _run(tok, ScriptedEngine(tok, ["a<|im_end|>"]), ScriptedEnv(done_at=0, starts=starts),
                              SamplingSpec(n=2, max_tokens=100))
    assert tok.decode(prompt_ids).endswith("123+45")
    assert a.loss_mask[:1] == [0] and tok.decode(a.token_ids[:a.loss_mask.index(1)]).startswith("6=")
    assert tok.decode(b.token_ids[:b.loss_mask.index(1)]).startswith("7=")


def test_reward_sources_and_what_the_reward_service_scores(tok: Any) -> None:
    engine = ScriptedEngine(tok, [CALL + "<|im_end|>", "579<|im_end|>"])
    loop = AgentLoop(tok, EnvironmentRouter(ScriptedEnv(done_at=1, reply="579"), []), AgentSettings())

    async def go() -> common_pb2.TrajectoryGroup:
        return await loop.play(_prompt(), SamplingSpec(n=2, max_tokens=200), "r/L9", "L9", "r", engine.generate,
                               cancelled=lambda: False, version=lambda: 0)

    group = asyncio.run(go())
    items = convert.score_items(group, "prompt", 200)
    r = group.responses[0]
    # DAPO's overlong length: the whole response from its first policy token (verl's attention mask)
    assert items[0].response_text == "579" and list(items[0].response_token_ids) == list(r.token_ids)
    assert 0 in r.loss_mask and r.loss_mask[0] == 1
    extra = json.loads(items[0].extra_info_json)
    assert extra["rollout_reward_scores"] == {"env_reward": 1.5}  # step 1.0 + close 0.5
    # verl's num_turns (ToolAgentLoop: user_turns + assistant_turns + 1): 2 assistant turns, the
    # environment's 2 user turns (the one that ended the episode too), the prompt
    assert r.num_turns == 2 and extra["num_turns"] == 5
    # The coordinator takes it: staleness from the policy tokens.
    (g,) = groups_from_request(coordinator_pb2.SubmitGroupsRequest(replica_id="r", groups=[group]), max_groups=1, max_tokens=200)
    assert (g.min_version, g.max_version) == (0, 0)
    for source, expected in (("reward_service", 0.25), ("sum", 1.75), ("environment", 1.5)):
        copy = common_pb2.TrajectoryGroup()
        copy.CopyFrom(group)
        for resp in copy.responses:
            resp.reward = 0.25
        apply_reward_source(copy, source)
        assert [x.reward for x in copy.responses] == [expected] * 2 and copy.responses[0].reward_metrics["env_reward"] == 1.5
    copy.responses[0].ClearField("env_reward")
    # the group fails (not InvalidArgument: the worker would stop the replica on it)
    with pytest.raises(FailedPrecondition, match="gave no reward"):
        apply_reward_source(copy, "environment")


# ---- in the worker ----------------------------------------------------------------------------------


def test_an_environment_outage_returns_the_lease_and_the_worker_goes_on(tok: Any) -> None:
    """After its endpoint's budget an environment fails the group: the lease goes back (the prompt
    is re-queued and counted by the coordinator), nothing is scored or submitted, the replica stays
    healthy and takes the prompt again; once the environment answers, the group is submitted."""
    from services.rollout.worker import RolloutWorker, WorkerSettings
    from tests.rollout_helpers import FakeCoordinator, length_scorer, wait_for

    env = ScriptedEnv(done_at=0, fail=True)
    engine = ScriptedEngine(tok, ["579<|im_end|>"])
    coord = FakeCoordinator([_prompt()], common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=64))
    agent = AgentLoop(tok, EnvironmentRouter(env, []), AgentSettings())

    async def go() -> None:
        worker = RolloutWorker(engine, tok, coord, length_scorer, None,
                               WorkerSettings(replica_id="w", concurrent_groups=1, idle_poll_s=0.05), agent=agent)
        worker._synced = True  # no weight fetcher: nothing to wait for
        worker.start()
        await wait_for(lambda: len(coord.returned) >= 2, what="the lease returned twice")
        assert coord.submitted == [] and worker.healthy and worker.counters.groups_failed >= 2
        env.fail = False
        await wait_for(lambda: len(coord.submitted) == 1, what="the group submitted once the environment is back")
        await worker.stop()

    asyncio.run(go())
    g = coord.submitted[0]
    assert all(r.loss_mask and r.final_text == "579" for r in g.responses)
    assert env.open == set()  # every session closed, the failed ones too
