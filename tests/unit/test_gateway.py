"""The OpenAI-compatible gateway without Ray: its real HTTP server (uvicorn on a free loopback port)
called by the official `openai` SDK, in front of a scripted policy engine (a hand-written engine
that answers each call of a sample with its next scripted turn). Sessions and keys, stitching of
calls into one token sequence, the loss mask, rewards, OpenAI's error codes as the SDK's
exceptions, streaming, text completions, agent programs (a real subprocess) and their deadline."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from meshrl.v1 import common_pb2, reward_pb2
from services.common.config import MeshConfig
from services.common.tiny import build_tokenizer
from services.rollout.agent.chat import ChatRenderer
from services.rollout.engines.base import Finish, GenerationRequest, SampleOutput, SamplingSpec
from services.rollout.gateway import GatewayAgent, GatewayGroupFailed, GatewayLimits, GatewaySettings, SessionRegistry
from services.rollout.gateway.app import GatewayServer, build_app
from services.rollout.gateway.openai_api import ApiError

CALL = '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call><|im_end|>'
ANSWER = "579<|im_end|>"
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
PROMPT = common_pb2.Prompt(prompt_id="p0", data_source="tool_add", messages=[common_pb2.ChatMessage(role="user", content="123+456=")])


class ScriptedPolicy:
    """generate(): call k of a sample answers turns[k] (logprob -0.5, the current version)."""

    def __init__(self, tok: Any, turns: Sequence[str]) -> None:
        self.tok = tok
        self.turns = [list(tok.encode(t, add_special_tokens=False)) for t in turns]
        self.calls: dict[str, int] = {}
        self.requests: list[GenerationRequest] = []
        self.version = 0

    async def generate(self, req: GenerationRequest) -> list[SampleOutput]:
        self.requests.append(req)
        m = re.match(r"^(.*/\d+)/c\d+-", req.request_id)  # <group rid>/<sample>/c<call>-<unique>
        assert m, req.request_id
        k = self.calls.get(m.group(1), 0)
        self.calls[m.group(1)] = k + 1
        ids = self.turns[min(k, len(self.turns) - 1)][: req.sampling.max_tokens]
        finish = Finish.STOP if ids and ids[-1] == self.tok.eos_token_id else Finish.LENGTH
        return [SampleOutput(0, list(ids), [-0.5] * len(ids), [self.version] * len(ids), finish)]


SCORED: list[int] = []  # items per call of score_by_text: whether the reward service was asked


async def score_by_text(items: list[reward_pb2.ScoreItem]) -> list[reward_pb2.ScoreResult]:
    SCORED.append(len(items))
    return [reward_pb2.ScoreResult(item_id=it.item_id, score=1.0 if it.response_text.strip() == "579" else 0.0)
            for it in items]


AgentFn = Callable[[str, str, dict[str, Any]], Awaitable[None]]


async def play(agent: AgentFn | None, turns: Sequence[str], *, n: int = 2, command: Sequence[str] | None = None,
               eta: int | None = None, timeout_s: float = 60.0, max_model_len: int = 512, budget: int = 256,
               policy: ScriptedPolicy | None = None, secret_env: frozenset[str] = frozenset(), tok: Any = None,
               max_concurrent: int = 4, endpoint: str | None = None,
               ) -> tuple[common_pb2.TrajectoryGroup | Exception, GatewayAgent, ScriptedPolicy]:
    tok = tok if tok is not None else build_tokenizer(tools=True)
    policy = policy or ScriptedPolicy(tok, turns)
    registry = SessionRegistry(tok, GatewayLimits(max_model_len=max_model_len, response_budget=budget,
                                                  max_staleness_versions=eta))
    ga = GatewayAgent(tok, registry, GatewaySettings(command=tuple(command) if command else None, endpoint=endpoint,
                                                     sample_timeout_s=timeout_s, max_concurrent=max_concurrent, launch=agent,
                                                     secret_env=secret_env),
                      scorer=score_by_text)
    server = GatewayServer(build_app(registry), "127.0.0.1", 0)
    port = await server.start()
    ga.base_url = lambda sid: f"http://127.0.0.1:{port}/sessions/{sid}/v1"
    try:
        result: common_pb2.TrajectoryGroup | Exception = await ga.play(
            PROMPT, SamplingSpec(n=n, max_tokens=budget), "rep/lease-1", "lease-1", "rep", policy.generate,
            cancelled=lambda: False, version=lambda: policy.version)
    except GatewayGroupFailed as exc:
        result = exc
    finally:
        await server.stop()
    return result, ga, policy


async def finish(base_url: str, key: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient() as c:
        return await c.post(base_url.rsplit("/v1", 1)[0] + "/finish", json=body, headers={"Authorization": f"Bearer {key}"})


async def tool_loop(base_url: str, key: str, prompt: dict[str, Any], *, reward: float | None = 1.0,
                    stream: bool = False) -> None:
    """An agent as people write them: the SDK, tools, one tool round, then the answer."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    messages: list[Any] = list(prompt["messages"])
    for _ in range(4):
        if stream:
            content, calls, finish_reason = "", {}, None
            async for ch in await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                                stream=True):
                d = ch.choices[0].delta
                content += d.content or ""
                for tc in d.tool_calls or []:
                    calls[tc.index] = {"id": tc.id, "type": "function",
                                       "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                finish_reason = ch.choices[0].finish_reason or finish_reason
            msg: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                msg["tool_calls"] = [calls[k] for k in sorted(calls)]
        else:
            resp = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            finish_reason = resp.choices[0].finish_reason
            msg = resp.choices[0].message.model_dump(exclude_none=True)
        messages.append(msg)
        if finish_reason != "tool_calls":
            break
        for tc in msg["tool_calls"]:
            args = json.loads(tc["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": str(args["a"] + args["b"])})
    await client.close()
    if reward is not None:
        r = await finish(base_url, key, {"reward": reward})
        assert r.status_code == 200, r.text


def test_tool_loop_through_the_sdk_becomes_one_masked_trajectory_per_sample() -> None:
    group, ga, policy = asyncio.run(play(tool_loop, [CALL, ANSWER]))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    tok = policy.tok
    assert len(group.responses) == 2 and ga.registry.counters["stitch_mismatches"] == 0
    assert ga.registry.counters["stitched_calls"] == 2
    call_ids, answer_ids = policy.turns
    # The second call continued from the exact ids of the first (never re-tokenized).
    second = [r for r in policy.requests if "/c1-" in r.request_id]
    first = [r for r in policy.requests if "/c0-" in r.request_id]
    assert second[0].prompt_token_ids[: len(first[0].prompt_token_ids) + len(call_ids)] == first[0].prompt_token_ids + call_ids
    renderer = ChatRenderer(tok)
    history = [{"role": "user", "content": "123+456="},
               {"role": "assistant", "content": tok.decode(call_ids, skip_special_tokens=True)},
               {"role": "tool", "content": "579"}]
    for r in group.responses:
        assert r.env_reward == 1.0
        mask, ids = list(r.loss_mask), list(r.token_ids)
        assert [t for t, m in zip(ids, mask, strict=True) if m] == call_ids + answer_ids
        assert ids[: len(call_ids)] == call_ids and mask[: len(call_ids)] == [1] * len(call_ids)
        env = ids[len(call_ids): len(ids) - len(answer_ids)]
        assert env and all(m == 0 for m in mask[len(call_ids): len(ids) - len(answer_ids)])
        assert "<tool_response>\n579\n</tool_response>" in tok.decode(env, skip_special_tokens=False)
        assert all(v == -1 for v, m in zip(r.versions, mask, strict=True) if not m)
        assert all(lp == -0.5 for lp, m in zip(r.logprobs, mask, strict=True) if m)
        assert r.num_turns == 2 and r.tool_calls == 1 and r.final_text == "579"
        # prompt + trajectory == a full re-render of the conversation (closed after the answer)
        full = list(group.prompt_token_ids) + ids + renderer.encode(renderer.tail(tok.decode(ids[-1:], skip_special_tokens=False)))
        assert full == renderer.encode(renderer.render([*history, {"role": "assistant", "content": "579"}],
                                                       add_generation_prompt=False))
    assert list(group.prompt_token_ids) == renderer.prompt_ids(history[:1])


def test_streaming_gives_the_same_answer_and_tool_calls() -> None:
    group, _, _ = asyncio.run(play(lambda u, k, p: tool_loop(u, k, p, stream=True), [CALL, ANSWER], n=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    (r,) = group.responses
    assert r.tool_calls == 1 and r.final_text == "579" and r.num_turns == 2 and r.env_reward == 1.0


def test_no_reward_means_the_reward_service_scores_the_last_answer() -> None:
    group, _, _ = asyncio.run(play(lambda u, k, p: tool_loop(u, k, p, reward=None), [CALL, ANSWER], n=2))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert [r.env_reward for r in group.responses] == [1.0, 1.0]


def test_errors_are_openai_errors_the_sdk_raises() -> None:
    seen: dict[str, Any] = {}
    done = asyncio.Event()

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        if prompt["sample_index"] != 0:
            await done.wait()  # the group ends once every sample finished: let sample 0 probe first
            return await tool_loop(url, key, prompt)
        msgs = prompt["messages"]
        bad_key = openai.AsyncOpenAI(base_url=url, api_key="not-the-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            await bad_key.chat.completions.create(model="m", messages=msgs)
        seen["401"] = e.value.body
        other = openai.AsyncOpenAI(base_url=url.replace(prompt["session_id"], "0" * 32), api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await other.models.list()
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        await c.chat.completions.create(model="m", messages=msgs)
        assert [m.id for m in (await c.models.list()).data] == ["meshrl-policy"]
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="m", messages=msgs, n=2)
        seen["n"] = e.value.param
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
        seen["role"] = e.value.param
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "9" * 600}])
        seen["long"] = e.value.code
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="m", messages=msgs, max_tokens=0)
        seen["max_tokens"] = e.value.param
        async with httpx.AsyncClient() as h:  # JSON nested past the parser's depth: the body's fault, a 400
            r = await h.post(url + "/chat/completions", content=b"[" * 100_000 + b"]" * 100_000,
                             headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        seen["deep"] = (r.status_code, r.json()["error"]["param"])
        assert (await finish(url, key, {"reward": "high"})).status_code == 400
        assert (await finish(url, key, {"reward": 0.5})).status_code == 200
        sent = []

        async def count(request: httpx.Request) -> None:
            sent.append(request.url.path)

        # the SDK's default retries: a 409 says `x-should-retry: false`, so it is sent once
        retrying = openai.AsyncOpenAI(base_url=url, api_key=key,
                                      http_client=httpx.AsyncClient(event_hooks={"request": [count]}))
        with pytest.raises(openai.ConflictError) as e:
            await retrying.chat.completions.create(model="m", messages=msgs)
        seen["409"] = e.value.code
        seen["sent"] = len(sent)
        assert (await finish(url, key, {})).status_code == 409
        for client in (bad_key, other, c, retrying):
            await client.close()
        done.set()

    group, ga, _ = asyncio.run(play(agent, [CALL, ANSWER], n=2, max_model_len=256))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert [r.env_reward for r in group.responses] == [0.5, 1.0]
    assert seen == {"401": seen["401"], "n": "n", "role": "messages[0].role", "long": "context_length_exceeded",
                    "max_tokens": "max_tokens", "409": "session_closed", "sent": 1, "deep": (400, "body")}
    assert seen["401"]["code"] == "invalid_api_key"
    assert ga.registry.counters["calls"] == 3  # the refused requests left no trace
    assert ga.registry.counters["rejected_auth"] == 2


def test_only_the_samples_own_state_tells_the_sdk_not_to_retry() -> None:
    final = {"x-should-retry": "false"}
    assert ApiError(409, "ended", code="session_closed").headers() == final
    assert ApiError(429, "out of calls", code="too_many_calls").headers() == final
    assert ApiError(503, "draining").headers() == {} and ApiError(400, "bad").headers() == {}


def test_an_agent_that_never_calls_the_model_fails_the_group() -> None:
    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        if prompt["sample_index"] == 1:
            await tool_loop(url, key, prompt)

    group, _, _ = asyncio.run(play(agent, [CALL, ANSWER], n=2))
    # its lease goes back (the prompt is re-queued), never scored as zero
    assert isinstance(group, GatewayGroupFailed) and "without calling the model" in str(group)


def test_a_history_that_does_not_extend_starts_a_new_segment() -> None:
    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        await c.chat.completions.create(model="m", messages=prompt["messages"], tools=TOOLS)
        # the agent rewrites the conversation (a summary): not an extension of the first call
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "sum: 123+456="}], tools=TOOLS)
        await c.close()
        await finish(url, key, {"reward": 0.0})

    group, ga, policy = asyncio.run(play(agent, [CALL, ANSWER], n=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert ga.registry.counters["stitch_mismatches"] == 1
    (r,) = group.responses
    assert r.env_metrics["gateway_stitch_mismatches"] == 1.0 and r.env_metrics["gateway_calls"] == 2.0
    assert [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if m] == policy.turns[1]  # the last segment
    assert "sum: 123+456=" in policy.tok.decode(list(group.prompt_token_ids) + list(r.token_ids))


def test_tool_call_ids_are_unique_within_a_session_across_segments() -> None:
    """An agent that keeps its own history (and frameworks that key tool results by id) must never
    see one tool_call id twice in a session: ids restarted at call_0_* in each new segment."""
    ids: list[str] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        r = await c.chat.completions.create(model="m", messages=prompt["messages"], tools=TOOLS)
        ids.append(r.choices[0].message.tool_calls[0].id)
        # the agent rewrites the conversation (a summary): a new segment
        msgs: list[Any] = [{"role": "user", "content": "sum: 123+456="}]
        r = await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        msg = r.choices[0].message.model_dump(exclude_none=True)
        ids.append(msg["tool_calls"][0]["id"])
        msgs += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "579"}]
        r = await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)  # stitched to the second
        ids.append(r.choices[0].message.tool_calls[0].id)
        await c.close()
        await finish(url, key, {"reward": 0.0})

    group, ga, policy = asyncio.run(play(agent, [CALL, CALL, CALL], n=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert len(ids) == 3 and len(set(ids)) == 3, ids
    (r,) = group.responses
    assert ga.registry.counters["stitch_mismatches"] == 1 and ga.registry.counters["stitched_calls"] == 1
    assert [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if m] == policy.turns[1] + policy.turns[2]


def test_malformed_tool_calls_count_as_calls_so_the_error_rate_is_per_call() -> None:
    """agent/tool_error_rate is tool_errors / tool_calls: the in-process loop counts a malformed call
    as a call and an error; the gateway counted only the error, so its rate passed 1."""
    bad = '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call><tool_call>{"name": "add", "arguments": {}}</tool_call><|im_end|>'

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        r = await c.chat.completions.create(model="m", messages=prompt["messages"], tools=TOOLS)
        assert r.choices[0].message.tool_calls is None  # answered as text: the agent sees what the policy wrote
        await c.close()
        await finish(url, key, {"reward": 0.0})

    group, _, _ = asyncio.run(play(agent, [bad], n=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    (r,) = group.responses
    assert (r.tool_calls, r.tool_errors) == (2, 1)
    # a turn cut at its max_tokens inside a block is neither (the loop does not parse a cut turn)
    group, _, _ = asyncio.run(play(agent, ['<tool_call>{"name": "add", "arguments": {"a": 1'], n=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    (r,) = group.responses
    assert (r.tool_calls, r.tool_errors, r.finish_reason) == (0, 0, common_pb2.FINISH_REASON_LENGTH)


def test_a_last_call_with_tool_choice_none_continues_the_trajectory_and_parses_no_call() -> None:
    """Tool rounds, then "answer now": the same tools with tool_choice="none" (OpenAI keeps the
    tools in the context and only forbids calls, as vLLM's server renders them). Rendered without
    the tools, the call did not stitch: a new segment, the tool-call turn dropped from training."""
    replies: list[dict[str, Any]] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        msgs: list[Any] = list(prompt["messages"])
        r = await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        msg = r.choices[0].message.model_dump(exclude_none=True)
        msgs += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "579"}]
        last = await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, tool_choice="none")
        replies.append(last.choices[0].message.model_dump(exclude_none=True) | {"finish": last.choices[0].finish_reason})
        await c.close()
        await finish(url, key, {"reward": 1.0})

    # the policy calls the tool again on the last call: tool_choice=none answers it as text
    group, ga, policy = asyncio.run(play(agent, [CALL, CALL], n=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    (r,) = group.responses
    assert r.num_turns == 2 and ga.registry.counters["segments_dropped"] == 0, ga.registry.counters
    assert [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if m] == policy.turns[0] + policy.turns[1]
    (reply,) = replies
    assert "tool_calls" not in reply and "<tool_call>" in reply["content"] and reply["finish"] == "stop"


def test_a_failed_group_stops_the_engine_requests_of_its_other_samples() -> None:
    """Sample 0's agent crashes while sample 1's call is decoding: the group fails and its lease
    goes back; sample 1's engine request is cancelled (the engines abort it) instead of decoding
    to its max_tokens for a session that no longer exists, and its call is a 409."""
    tok = build_tokenizer(tools=True)
    outcome: list[str] = []

    class SlowPolicy(ScriptedPolicy):
        started = asyncio.Event()

        async def generate(self, req: GenerationRequest) -> list[SampleOutput]:
            if "/1/" in req.request_id:
                self.started.set()
                try:
                    await asyncio.sleep(3.0)  # the server's graceful stop would let it end
                except asyncio.CancelledError:
                    outcome.append("cancelled")
                    raise
                outcome.append("ran to the end")
            return await super().generate(req)

    policy = SlowPolicy(tok, [ANSWER])

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        if prompt["sample_index"] == 0:
            await policy.started.wait()
            raise RuntimeError("agent 0 crashed")
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        await c.chat.completions.create(model="m", messages=prompt["messages"])

    group, _, _ = asyncio.run(play(agent, [ANSWER], policy=policy))
    assert isinstance(group, GatewayGroupFailed), group
    assert outcome == ["cancelled"]


@pytest.mark.parametrize("tools", [False, True])
def test_qwen3s_template_that_drops_earlier_reasoning_still_stitches_the_next_call(tools: bool) -> None:
    """Qwen3's template renders an earlier assistant turn without its <think> block (a non-empty
    one once a new user query follows, an empty one once any message follows): the earlier render
    is no prefix of the new one and the reply as sampled is not in it. The follow-up call was a
    400 (the agent crashed, the group failed, its prompt came back again and again)."""
    from tests.unit.agent_fixtures.qwen3_template import qwen3_tokenizer

    tok = qwen3_tokenizer()
    first = ('<think>\n\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 123, "b": 456}}\n</tool_call><|im_end|>'
             if tools else "<think>\nthe user says hi\n</think>\n\nHello!<|im_end|>")
    policy = ScriptedPolicy(tok, [first, "<think>\nagain\n</think>\n\nFine.<|im_end|>"])
    errors: list[str] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        msgs: list[Any] = [{"role": "user", "content": "hi"}]
        extra: dict[str, Any] = {"tools": TOOLS} if tools else {}
        r = await c.chat.completions.create(model="m", messages=msgs, **extra)
        msg = r.choices[0].message.model_dump(exclude_none=True)
        msgs.append(msg)
        if tools:
            msgs.append({"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "579"})
        else:
            msgs.append({"role": "user", "content": "how are you?"})
        try:
            await c.chat.completions.create(model="m", messages=msgs, **extra)
        except openai.APIStatusError as exc:
            errors.append(f"{exc.status_code}: {exc.message}")
        await c.close()
        await finish(url, key, {"reward": 1.0})

    group, ga, policy = asyncio.run(play(agent, [], n=1, policy=policy, tok=tok, max_model_len=2048, budget=1024))
    assert errors == [], errors
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    (r,) = group.responses
    assert r.num_turns == 2 and ga.registry.counters["segments_dropped"] == 0, ga.registry.counters
    # what the policy sampled is trained as sampled; the new message is in the context between
    assert [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if m] == policy.turns[0] + policy.turns[1]
    text = tok.decode(list(group.prompt_token_ids) + list(r.token_ids))
    assert ("<tool_response>\n579\n</tool_response>" if tools else "how are you?") in text


def test_samples_whose_first_prompts_differ_share_their_common_prefix_and_stay_within_the_context() -> None:
    """Each agent opens with its own system prompt: the group's prompt is what they share, each
    sample's rest opens its response (mask 0). The budget counts from the sample's own prompt, so
    the response may pass it by that rest; its trained tokens may not, nor prompt + response the
    model's context (README, "What is recorded")."""
    budget, max_model_len = 12, 96

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        system = {"role": "system", "content": "you are agent " + "x" * (3 + 7 * prompt["sample_index"])}
        await c.chat.completions.create(model="m", messages=[system, *prompt["messages"]], tools=TOOLS)
        await c.close()
        await finish(url, key, {"reward": 0.0})

    long_answer = "5" * 40 + "<|im_end|>"
    group, _, policy = asyncio.run(play(agent, [long_answer], n=3, budget=budget, max_model_len=max_model_len))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    shared = list(group.prompt_token_ids)
    rests = []
    for r, req in zip(sorted(group.responses, key=lambda r: r.sample_index),
                      sorted(policy.requests, key=lambda q: int(q.request_id.split("/")[2])), strict=True):
        policy_ids = [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if m]
        rest = len(req.prompt_token_ids) - len(shared)
        rests.append(rest)
        assert list(req.prompt_token_ids) == shared + list(r.token_ids[:rest])  # the sample's own prompt
        assert set(r.loss_mask[:rest]) <= {0} and policy_ids == list(r.token_ids[rest:])
        assert len(policy_ids) == budget and r.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(shared) + len(r.token_ids) <= max_model_len
    assert max(rests) > 0 and len(set(rests)) > 1  # the prompts did differ, by different amounts
    assert max(len(r.token_ids) for r in group.responses) > budget  # what the README says may happen


def test_a_call_past_max_staleness_versions_is_409_and_only_that_sample_starts_over() -> None:
    """Sample 0 calls at version 0, two updates land while it runs its tool, its next call is 409
    policy_too_stale; its agent is started again in a new session of the same lease, while sample 1
    (whose calls came after the updates) keeps its work."""
    codes: list[str | None] = []
    runs: list[int] = []
    holder: dict[str, ScriptedPolicy] = {}
    bumped = asyncio.Event()
    old: list[tuple[str, str]] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        i = prompt["sample_index"]
        runs.append(i)
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        msgs = list(prompt["messages"])
        if i == 1:
            await bumped.wait()
        resp = await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        if i == 0 and runs.count(0) == 1:
            holder["p"].version = 2  # two weight updates while the agent ran its tool
            bumped.set()
            msgs += [resp.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": resp.choices[0].message.tool_calls[0].id, "content": "579"}]
            try:
                await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
            except openai.ConflictError as exc:
                codes.append(exc.code)
                old.append((url, key))
                raise
            finally:
                await c.close()
        await c.close()
        assert (await finish(url, key, {"reward": 1.0})).status_code == 200

    tok = build_tokenizer(tools=True)
    holder["p"] = ScriptedPolicy(tok, [CALL, ANSWER])
    group, ga, policy = asyncio.run(play(agent, [], n=2, eta=1, policy=holder["p"]))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert codes == ["policy_too_stale"] and ga.registry.counters["rejected_stale"] == 1
    assert ga.counters["samples_restarted"] == 1 and sorted(runs) == [0, 0, 1] and ga.counters["groups_failed"] == 0
    r0, r1 = sorted(group.responses, key=lambda r: r.sample_index)
    # sample 0 is its second session's work only (one call, the answer, at version 2)
    assert [t for t, m in zip(r0.token_ids, r0.loss_mask, strict=True) if m] == policy.turns[1]
    assert {v for v, m in zip(r0.versions, r0.loss_mask, strict=True) if m} == {2} and r0.num_turns == 1
    # sample 1 kept its one call
    assert [t for t, m in zip(r1.token_ids, r1.loss_mask, strict=True) if m] == policy.turns[0]
    assert [r.env_reward for r in (r0, r1)] == [1.0, 1.0]


def test_a_sample_that_keeps_falling_behind_returns_the_lease() -> None:
    """Every session of sample 0 sees the policy move past max_staleness_versions=0 between its two
    calls: after GatewayLimits.max_sample_restarts (3) restarts the group goes back, with the reason."""
    holder: dict[str, ScriptedPolicy] = {}

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        try:
            msgs = list(prompt["messages"])
            resp = await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
            holder["p"].version += 1
            msgs += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
            await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        finally:
            await c.close()

    tok = build_tokenizer(tools=True)
    holder["p"] = ScriptedPolicy(tok, [ANSWER])
    group, ga, _ = asyncio.run(play(agent, [], n=1, eta=0, policy=holder["p"]))
    assert isinstance(group, GatewayGroupFailed) and "started over 3 times" in str(group), group
    assert ga.counters["samples_restarted"] == 3 and ga.registry.counters["rejected_stale"] == 4


def test_text_completions_stitch_on_the_text_prefix() -> None:
    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        r1 = await c.completions.create(model="m", prompt="123+456=", max_tokens=8, logprobs=1)
        assert r1.choices[0].logprobs is not None and r1.choices[0].logprobs.token_logprobs[0] == -0.5
        await c.completions.create(model="m", prompt="123+456=" + r1.choices[0].text + " so", max_tokens=8)
        await c.close()
        await finish(url, key, {"reward": 1.0})

    group, ga, policy = asyncio.run(play(agent, ["579", "!"], n=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    (r,) = group.responses
    assert policy.tok.decode(list(r.token_ids)) == "579 so!" and list(r.loss_mask) == [1, 1, 1, 0, 0, 0, 1]
    assert ga.registry.counters["stitched_calls"] == 1


def test_a_text_completion_cut_at_max_tokens_and_continued_as_is_extends_the_sample() -> None:
    """An agent that generates in chunks (max_tokens per call) sends back exactly prompt + completion
    to continue: nothing is added, so the call continues the exact ids so far. A new segment would
    drop the first call's sampled tokens from training and make them the group's prompt."""
    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        r1 = await c.completions.create(model="m", prompt="123+456=", max_tokens=2)
        assert r1.choices[0].finish_reason == "length"
        await c.completions.create(model="m", prompt="123+456=" + r1.choices[0].text, max_tokens=8)
        await c.close()
        await finish(url, key, {"reward": 1.0})

    group, ga, policy = asyncio.run(play(agent, ["579<|im_end|>", "9<|im_end|>"], n=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    (r,) = group.responses
    assert policy.tok.decode(list(group.prompt_token_ids)) == "123+456="
    assert policy.tok.decode(list(r.token_ids)) == "579<|im_end|>" and list(r.loss_mask) == [1] * len(r.token_ids)
    assert ga.registry.counters["stitched_calls"] == 1 and ga.registry.counters["segments_dropped"] == 0
    assert r.num_turns == 2


AGENT_PROGRAM = textwrap.dedent("""
    import json, os, sys, time, httpx, openai
    prompt = json.load(sys.stdin)
    assert not [k for k in os.environ if k.startswith("MESHRL_") and k != "MESHRL_SESSION_ID"], "mesh secrets leaked"
    assert not {"RAY_AUTH_TOKEN", "RUN_OP_TOKEN"} & set(os.environ), "Ray's or a renamed role token leaked"
    assert os.environ["AGENT_OWN_KEY"] == "kept", "the agent's own environment is passed on"
    mode = sys.argv[1]
    if mode == "fail" and prompt["sample_index"] == 1:
        print("openai.AuthenticationError: key", os.environ["OPENAI_API_KEY"], "refused", file=sys.stderr)
        sys.exit(3)
    if mode == "hang":
        time.sleep(3600)
    if mode == "loud":
        sys.stderr.write("x" * (4 << 20) + "\\nthe last words\\n")
        sys.exit(4)
    c = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    r = c.chat.completions.create(model="m", messages=prompt["messages"])
    print("answer", r.choices[0].message.content)
    if mode == "finish":
        httpx.post(os.environ["OPENAI_BASE_URL"].rsplit("/v1", 1)[0] + "/finish", json={"reward": 0.25},
                   headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}).raise_for_status()
""")


async def _failed_group_message(agent: AgentFn | None = None, endpoint: str | None = None) -> str:
    """Play one sample whose agent fails; the group's failure message."""
    group, _, _ = await play(agent, [CALL, ANSWER], n=1, timeout_s=30, endpoint=endpoint)
    assert isinstance(group, GatewayGroupFailed), "the group should have failed"
    return str(group)


def test_a_launched_agents_failure_message_never_holds_the_session_key() -> None:
    """A failed agent's error becomes the group's failure, which the worker logs and sends to the
    coordinator. The command path cut the session's key out of it; the launch and endpoint paths
    did not."""
    keys: list[str] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        keys.append(key)
        raise RuntimeError(f"the model server refused api key {key}")

    msg = asyncio.run(_failed_group_message(agent))
    assert keys and keys[0] not in msg, msg


def test_an_agent_endpoints_failure_message_never_holds_the_session_key() -> None:
    """An agent.endpoint that echoes the body it received (api_key included) in its error."""
    keys: list[str] = []
    service = FastAPI()

    @service.post("/run")
    async def run(request: Request) -> PlainTextResponse:
        body = await request.json()
        keys.append(body["api_key"])
        return PlainTextResponse(f"refused: api_key={body['api_key']}", status_code=400)

    async def main() -> str:
        svc = GatewayServer(service, "127.0.0.1", 0)
        p = await svc.start()
        try:
            return await _failed_group_message(endpoint=f"http://127.0.0.1:{p}/run")
        finally:
            await svc.stop()

    msg = asyncio.run(main())
    assert keys and keys[0] not in msg, msg


def test_an_agent_that_lingers_after_finish_does_not_fail_its_group() -> None:
    """Sample 0's agent calls /finish (its trajectory and reward are recorded), then takes past
    agent.sample_timeout_s to exit (tearing down its sandbox) while it holds the only agent slot.
    The deadline failed the group and returned its lease, discarding every finished sample."""

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        await tool_loop(url, key, prompt, reward=1.0)
        if prompt["sample_index"] == 0:
            await asyncio.sleep(30)

    group, ga, _ = asyncio.run(play(agent, [ANSWER], n=2, timeout_s=1.5, max_concurrent=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert [r.env_reward for r in group.responses] == [1.0, 1.0] and ga.counters["deadlines"] == 1


@pytest.mark.parametrize("mode", ["finish", "exit0", "fail", "hang", "loud"])
def test_agent_programs(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHRL_ROLLOUT_TOKEN", "secret")
    # security.operator_token_env: RUN_OP_TOKEN names a role token outside MESHRL_*
    monkeypatch.setenv("RUN_OP_TOKEN", "secret")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    monkeypatch.setenv("AGENT_OWN_KEY", "kept")
    prog = tmp_path / "agent.py"
    prog.write_text(AGENT_PROGRAM)
    command = [sys.executable, str(prog), mode]
    if mode == "loud":  # 4 MiB of stderr under a 1 MiB file-size limit: kept in no file, only its tail
        command = ["bash", "-c", f"ulimit -f 1024; exec {sys.executable} {prog} loud"]
    group, ga, _ = asyncio.run(play(None, [ANSWER], n=2, command=command,
                                    timeout_s=3.0 if mode == "hang" else 60.0, secret_env=frozenset({"RUN_OP_TOKEN"})))
    if mode in ("finish", "exit0"):
        assert isinstance(group, common_pb2.TrajectoryGroup), group
        assert [r.env_reward for r in group.responses] == ([0.25] * 2 if mode == "finish" else [1.0] * 2)
    elif mode == "fail":
        assert isinstance(group, GatewayGroupFailed) and "exited with 3" in str(group)
        # its stderr's tail travels to the coordinator and its logs: the session's key does not
        assert "key <the session's key> refused" in str(group), group
    elif mode == "loud":
        assert isinstance(group, GatewayGroupFailed) and "exited with 4" in str(group), group
        assert str(group).rstrip().endswith("the last words") and len(str(group)) < 2000
    else:
        assert isinstance(group, GatewayGroupFailed) and "agent.sample_timeout_s" in str(group)
        assert ga.counters["deadlines"] >= 1  # the first deadline fails the group and stops the other agent


def test_the_secrets_agents_never_inherit_are_named_by_the_config() -> None:
    from services.rollout.gateway import secret_env_names

    cfg = MeshConfig.model_validate({
        "security": {"operator_token_env": "RUN_OP_TOKEN"},
        "reward": {"endpoints": [{"address": "127.0.0.1:1", "name": "judge", "data_sources": ["x"],
                                  "token_env": "JUDGE_KEY"}]},
    })
    assert {"RUN_OP_TOKEN", "JUDGE_KEY", "MESHRL_ROLLOUT_TOKEN", "MESHRL_TRAINER_TOKEN"} <= secret_env_names(cfg)


def test_the_gateway_server_starts_once_for_groups_that_arrive_together() -> None:
    tok = build_tokenizer(tools=True)
    ga = GatewayAgent(tok, SessionRegistry(tok, GatewayLimits(max_model_len=64, response_budget=32)),
                      GatewaySettings(command=None, endpoint=None, sample_timeout_s=1, max_concurrent=1))
    starts = []

    async def start() -> None:
        starts.append(1)
        await asyncio.sleep(0.05)  # binding takes a moment: the other groups arrive meanwhile
        ga.base_url = lambda sid: f"http://127.0.0.1:1/sessions/{sid}/v1"

    ga.start_server = start

    async def main() -> None:
        await asyncio.gather(*(ga.ensure_server() for _ in range(4)))

    asyncio.run(main())
    assert starts == [1]


def test_agent_config_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = MeshConfig.model_validate({"agent": {"command": ["python", "a.py"]}})
    assert cfg.agent.enabled and cfg.agent.port == 0 and cfg.agent.command == ["python", "a.py"]
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    rel = "examples/gateway_agent/tool_add_agent.py"
    cfg = MeshConfig.model_validate({"agent": {"command": ["python", rel, "--reward-self"]}})
    assert cfg.agent.command == ["python", str(Path(rel).resolve()), "--reward-self"]
    with pytest.raises(ValueError, match="not both"):
        MeshConfig.model_validate({"agent": {"command": ["a"], "endpoint": "http://x"}})
    with pytest.raises(ValueError, match=r"multi_turn\.enable"):
        MeshConfig.model_validate({"agent": {"command": ["a"]},
                                   "actor_rollout_ref": {"rollout": {"multi_turn": {"enable": True}}}})


def test_agent_endpoint_gets_each_sample_and_finishes_it() -> None:
    """agent.endpoint: meshrl POSTs {prompt, base_url, api_key, session_id}; the service runs the agent."""
    received: list[dict[str, Any]] = []
    service = FastAPI()
    running: list[asyncio.Task[None]] = []

    @service.post("/run")
    async def run(request: Request) -> dict[str, str]:
        body = await request.json()
        received.append(body)
        running.append(asyncio.get_running_loop().create_task(tool_loop(body["base_url"], body["api_key"], body["prompt"])))
        return {"status": "started"}

    async def main() -> tuple[common_pb2.TrajectoryGroup, GatewayAgent]:
        svc = GatewayServer(service, "127.0.0.1", 0)
        svc_port = await svc.start()
        tok = build_tokenizer(tools=True)
        policy = ScriptedPolicy(tok, [CALL, ANSWER])
        registry = SessionRegistry(tok, GatewayLimits(max_model_len=512, response_budget=256))
        ga = GatewayAgent(tok, registry, GatewaySettings(command=None, endpoint=f"http://127.0.0.1:{svc_port}/run",
                                                         sample_timeout_s=60, max_concurrent=4))
        gw = GatewayServer(build_app(registry), "127.0.0.1", 0)
        port = await gw.start()
        ga.base_url = lambda sid: f"http://127.0.0.1:{port}/sessions/{sid}/v1"
        try:
            group = await ga.play(PROMPT, SamplingSpec(n=2, max_tokens=256), "r/l", "l", "r", policy.generate,
                                  cancelled=lambda: False, version=lambda: 0)
        finally:
            await asyncio.gather(*running)
            await gw.stop()
            await svc.stop()
        return group, ga

    group, _ = asyncio.run(main())
    assert sorted(b["prompt"]["sample_index"] for b in received) == [0, 1]
    assert all(b["base_url"].endswith(f"/sessions/{b['session_id']}/v1") and b["api_key"] for b in received)
    assert [r.env_reward for r in group.responses] == [1.0, 1.0] and all(r.tool_calls == 1 for r in group.responses)


# ---- in the worker ------------------------------------------------------------------------------------


def _worker_run(command: list[str], until: Callable[[Any], bool]) -> Any:
    """A RolloutWorker whose agent is the gateway (factory.build_agent from agent.command), a
    scripted engine and a hand-written coordinator; runs until `until(coordinator)`."""
    from services.rollout import factory
    from services.rollout.worker import RolloutWorker, WorkerSettings
    from tests.rollout_helpers import FakeCoordinator, wait_for
    from tests.unit.test_agent_loop import ScriptedEngine

    class Engine(ScriptedEngine):
        def __init__(self, tok: Any) -> None:
            super().__init__(tok, [CALL, ANSWER])
            self.policy = ScriptedPolicy(tok, [CALL, ANSWER])

        async def generate(self, request: GenerationRequest) -> list[SampleOutput]:
            return await self.policy.generate(request)

    tok = build_tokenizer(tools=True)
    cfg = MeshConfig.model_validate({"agent": {"command": command, "sample_timeout_s": 60}})
    settings = WorkerSettings(replica_id="w", concurrent_groups=2, idle_poll_s=0.05)
    agent = factory.build_agent(cfg, tok, settings, scorer=score_by_text)
    assert isinstance(agent, GatewayAgent)
    coord = FakeCoordinator([PROMPT, PROMPT], common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=96))

    async def go() -> None:
        worker = RolloutWorker(Engine(tok), tok, coord, score_by_text, None, settings, agent=agent)
        worker._synced = True  # no weight fetcher: nothing to wait for
        worker.start()
        try:
            await wait_for(lambda: until(coord), what="the worker's groups")
            assert worker.healthy
        finally:
            await worker.stop()

    asyncio.run(go())
    return coord


def test_the_worker_submits_groups_played_by_agent_programs() -> None:
    agent = Path(__file__).resolve().parents[2] / "examples" / "gateway_agent" / "tool_add_agent.py"
    coord = _worker_run(["python", str(agent)], lambda c: len(c.submitted) == 2)  # python: the replica's own
    assert coord.returned == []
    for g in coord.submitted:
        assert [r.reward for r in g.responses] == [1.0, 1.0]  # the reward service scored "579"
        assert [(r.tool_calls, r.num_turns, 0 in r.loss_mask) for r in g.responses] == [(1, 2, True)] * 2


def test_a_failing_agent_program_returns_the_lease() -> None:
    coord = _worker_run([sys.executable, "-c", "import sys; sys.exit(2)"], lambda c: len(c.errors) >= 2)
    assert coord.submitted == [] and all("exited with 2" in e for e in coord.errors)


def test_a_drain_that_finishes_in_flight_groups_lets_a_gateway_group_finish() -> None:
    """drain(finish_in_flight=True) waits for multi-turn groups that began (worker.py, agent_started):
    a gateway group whose agents are still working when the drain begins is finished and submitted,
    not failed and given back with an error the coordinator counts as a failed group."""
    from services.rollout.worker import RolloutWorker, WorkerSettings
    from tests.rollout_helpers import FakeCoordinator, wait_for
    from tests.unit.test_agent_loop import ScriptedEngine

    tok = build_tokenizer(tools=True)
    draining = asyncio.Event()
    waiting: list[str] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        waiting.append(key)
        await draining.wait()  # still working when the drain begins
        await tool_loop(url, key, prompt)

    class Engine(ScriptedEngine):
        def __init__(self) -> None:
            super().__init__(tok, [CALL, ANSWER])
            self.policy = ScriptedPolicy(tok, [CALL, ANSWER])

        async def generate(self, request: GenerationRequest) -> list[SampleOutput]:
            return await self.policy.generate(request)

    registry = SessionRegistry(tok, GatewayLimits(max_model_len=512, response_budget=96))
    ga = GatewayAgent(tok, registry, GatewaySettings(command=None, endpoint=None, sample_timeout_s=60, max_concurrent=4,
                                                     launch=agent), scorer=score_by_text)
    coord = FakeCoordinator([PROMPT], common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=96))

    async def go() -> None:
        server = GatewayServer(build_app(registry), "127.0.0.1", 0)
        port = await server.start()
        ga.base_url = lambda sid: f"http://127.0.0.1:{port}/sessions/{sid}/v1"
        worker = RolloutWorker(Engine(), tok, coord, score_by_text, None,
                               WorkerSettings(replica_id="w", concurrent_groups=1, idle_poll_s=0.05), agent=ga)  # type: ignore[arg-type]
        worker._synced = True
        worker.start()
        try:
            await wait_for(lambda: len(waiting) == 2, what="both agents started")
            drain = asyncio.ensure_future(worker.drain(finish_in_flight=True))
            await asyncio.sleep(1.0)  # the drain is under way (the group polls cancelled() every 0.5 s)
            draining.set()
            await asyncio.wait_for(drain, 30)
        finally:
            draining.set()
            await worker.stop()
            await server.stop()

    asyncio.run(go())
    assert coord.errors == [] and coord.returned == []
    assert len(coord.submitted) == 1 and [r.env_reward for r in coord.submitted[0].responses] == [1.0, 1.0]


def test_a_call_cut_by_a_weight_update_is_continued_on_the_new_weights() -> None:
    """Partial rollout, mode abort: the engine returns the call's first 5 tokens aborted and moves
    to version 1; the gateway continues from prompt + those tokens, and the client sees one answer."""
    tok = build_tokenizer(tools=True)

    class Cutting(ScriptedPolicy):
        async def generate(self, req: GenerationRequest) -> list[SampleOutput]:
            if not any(r.request_id.endswith("/r1") for r in self.requests) and "/r" not in req.request_id:
                self.requests.append(req)
                ids = self.turns[0][:5]
                self.version = 1
                return [SampleOutput(0, list(ids), [-0.5] * 5, [0] * 5, Finish.ABORT)]
            out = await super().generate(req)
            if req.request_id.endswith("/r1"):
                out[0].token_ids, out[0].logprobs, out[0].versions = (out[0].token_ids[5:], out[0].logprobs[5:],
                                                                      out[0].versions[5:])
            return out

    policy = Cutting(tok, ["the sum is 579<|im_end|>"])
    got: list[str] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        r = await c.chat.completions.create(model="m", messages=prompt["messages"])
        got.append(r.choices[0].message.content or "")
        await c.close()
        await finish(url, key, {"reward": 1.0})

    group, _, _ = asyncio.run(play(agent, [], n=1, policy=policy))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert got == ["the sum is 579"]
    (r,) = group.responses
    assert list(r.token_ids) == policy.turns[0] and list(r.versions) == [0] * 5 + [1] * (len(policy.turns[0]) - 5)
    first, cont = policy.requests[0], policy.requests[1]
    assert cont.request_id.endswith("/r1") and cont.prompt_token_ids == first.prompt_token_ids + policy.turns[0][:5]
    assert group.min_policy_version == 0 and group.max_policy_version == 1


def test_a_call_cut_more_often_than_max_resubmits_says_so_and_leaves_the_session_open() -> None:
    """Every continuation of the call is cut again (weight updates faster than it generates): past
    max_resubmits the call was answered 409 "session ended while this call was generating", yet the
    session was open; an agent believed its sample over and stopped, and the group waited for it."""
    from services.rollout.gateway.openai_api import parse_chat

    async def main() -> tuple[Any, Any, int]:
        tok = build_tokenizer(tools=True)
        policy = ScriptedPolicy(tok, [ANSWER])

        async def cutting(req: GenerationRequest) -> list[SampleOutput]:
            policy.requests.append(req)
            policy.version += 1
            return [SampleOutput(0, policy.turns[0][:1], [-0.5], [policy.version], Finish.ABORT)]

        registry = SessionRegistry(tok, GatewayLimits(max_model_len=512, response_budget=256, max_resubmits=2))
        g = registry.open_group("r/l", SamplingSpec(n=1, max_tokens=256), cutting, lambda: policy.version)
        (s,) = g.samples
        try:
            await registry.chat(s, parse_chat({"messages": [{"role": "user", "content": "123+456="}]}))
        except ApiError as exc:
            return exc, s, len(policy.requests)
        return None, s, len(policy.requests)

    err, s, engine_calls = asyncio.run(main())
    assert engine_calls == 3  # the call and max_resubmits=2 continuations
    assert isinstance(err, ApiError) and err.code == "resubmit_limit", err
    assert err.status == 503 and err.body()["error"]["type"] == "service_unavailable"
    # names the key that raises it (async_training.max_resubmits) as well as the mode that avoids it
    assert "async_training.max_resubmits=2" in err.message and "partial_rollout_mode=keep" in err.message, err.message
    assert s.state == "open" and s.segments == [] and s.calls == 0


def test_a_stop_string_across_the_cut_of_a_continued_call_ends_the_call_there() -> None:
    """The engine that continues a cut call sees only the continuation's text, so a stop string
    (the request's `stop`) that began in the aborted part and completes in the continuation went
    unseen: the answer and the recorded tokens ran on past it."""
    tok = build_tokenizer(tools=True)
    turn = "zebra quokka narwhal wombat<|im_end|>"
    ids = list(tok.encode(turn, add_special_tokens=False))
    before, after = tok.decode(ids[:5]), tok.decode(ids[:6])
    stop = before[-2:] + after[len(before)]
    assert len(before) >= 2 and turn.count(stop) == 1

    class Cutting(ScriptedPolicy):
        async def generate(self, req: GenerationRequest) -> list[SampleOutput]:
            if "/r" not in req.request_id:
                self.requests.append(req)
                self.version = 1
                return [SampleOutput(0, ids[:5], [-0.5] * 5, [0] * 5, Finish.ABORT)]
            out = await super().generate(req)
            out[0].token_ids, out[0].logprobs, out[0].versions = (out[0].token_ids[5:], out[0].logprobs[5:],
                                                                  out[0].versions[5:])
            return out

    policy = Cutting(tok, [turn])
    got: list[tuple[str, str]] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        r = await c.chat.completions.create(model="m", messages=prompt["messages"], stop=[stop])
        got.append((r.choices[0].message.content or "", r.choices[0].finish_reason))
        await c.close()
        await finish(url, key, {"reward": 1.0})

    group, _, _ = asyncio.run(play(agent, [], n=1, policy=policy))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert got == [(turn[: turn.index(stop)], "stop")], got
    (r,) = group.responses
    assert list(r.token_ids) == ids[:6] and list(r.versions) == [0] * 5 + [1]


def test_keys_of_an_ended_group_get_409_then_401() -> None:
    creds: list[tuple[str, str]] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        creds.append((url, key))
        await tool_loop(url, key, prompt)

    async def main() -> list[int]:
        tok = build_tokenizer(tools=True)
        policy = ScriptedPolicy(tok, [CALL, ANSWER])
        registry = SessionRegistry(tok, GatewayLimits(max_model_len=512, response_budget=256, ended_sessions_kept=1))
        ga = GatewayAgent(tok, registry, GatewaySettings(command=None, endpoint=None, sample_timeout_s=60,
                                                         max_concurrent=4, launch=agent), scorer=score_by_text)
        server = GatewayServer(build_app(registry), "127.0.0.1", 0)
        port = await server.start()
        ga.base_url = lambda sid: f"http://127.0.0.1:{port}/sessions/{sid}/v1"
        try:
            await ga.play(PROMPT, SamplingSpec(n=2, max_tokens=256), "r/l", "l", "r", policy.generate,
                          cancelled=lambda: False, version=lambda: 0)
            codes = []
            async with httpx.AsyncClient() as c:
                for url, key in creds:  # the first sample's id was forgotten (ended_sessions_kept=1)
                    r = await c.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"})
                    codes.append(r.status_code)
                    # a 409 is final: the SDKs would otherwise retry it with backoff
                    assert r.headers.get("x-should-retry") == ("false" if r.status_code == 409 else None)
                url, key = creds[1]
                codes.append((await c.get(f"{url}/models", headers={"Authorization": "Bearer wrong"})).status_code)
            return codes
        finally:
            await server.stop()

    assert sorted(asyncio.run(main())) == [401, 401, 409]


def test_a_stream_carries_every_tokens_logprob_and_the_usage() -> None:
    got: dict[str, Any] = {}

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        content, lps, usage, finish_reason = "", [], None, None
        async for ch in await c.chat.completions.create(model="m", messages=prompt["messages"], stream=True,
                                                        logprobs=True, stream_options={"include_usage": True}):
            usage = ch.usage or usage
            for choice in ch.choices:
                content += choice.delta.content or ""
                lps += [x.logprob for x in (choice.logprobs.content if choice.logprobs and choice.logprobs.content else [])]
                finish_reason = choice.finish_reason or finish_reason
        got.update(content=content, lps=lps, usage=usage, finish=finish_reason)
        await c.close()
        await finish(url, key, {"reward": 1.0})

    group, _, policy = asyncio.run(play(agent, [ANSWER], n=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    n = len(policy.turns[0])  # "579" and the end-of-turn token
    assert got["content"] == "579" and got["lps"] == [-0.5] * n and got["finish"] == "stop"
    assert got["usage"].completion_tokens == n and got["usage"].prompt_tokens == len(group.prompt_token_ids)


def test_the_replica_server_binds_agent_host_and_advertises_agent_advertise_host() -> None:
    from services.rollout.gateway import build_gateway_agent

    cfg = MeshConfig.model_validate({"agent": {"command": ["python", "a.py"], "advertise_host": "gw.example"}})

    async def main() -> tuple[str, int]:
        ga = build_gateway_agent(cfg, build_tokenizer(tools=True), scorer=None, max_model_len=128)
        assert ga.start_server is not None and ga.stop_server is not None
        await ga.start_server()
        try:
            assert ga.base_url is not None
            url = ga.base_url("abc")
            port = int(url.split(":")[2].split("/")[0])
            async with httpx.AsyncClient() as c:  # listening on loopback (agent.host), keys required
                status = (await c.get(f"http://127.0.0.1:{port}/sessions/abc/v1/models")).status_code
            return url, status
        finally:
            await ga.aclose()

    url, status = asyncio.run(main())
    assert url.startswith("http://gw.example:") and url.endswith("/sessions/abc/v1") and status == 401


def test_a_rewritten_echo_that_renders_to_the_same_ids_is_stitched_on_token_ids() -> None:
    """The agent echoes the policy's turn as raw text (its own copy, no tool_calls field): not the
    message we returned, but it renders to the exact ids so far, so the call continues them."""

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        msgs = list(prompt["messages"])
        await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        raw = CALL.replace("<|im_end|>", "")
        msgs += [{"role": "assistant", "content": raw}, {"role": "tool", "tool_call_id": "x", "content": "579"}]
        await c.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        await c.close()
        await finish(url, key, {"reward": 1.0})

    group, ga, policy = asyncio.run(play(agent, [CALL, ANSWER], n=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert ga.registry.counters["stitch_mismatches"] == 0 and ga.registry.counters["stitched_calls"] == 1
    (r,) = group.responses
    assert [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if m] == policy.turns[0] + policy.turns[1]
    assert r.num_turns == 2


async def _raw_call(path: str, body: bytes, *, eta: int | None = None, template_prefix: str = "",
                    turns: Sequence[str] = (ANSWER,), max_model_len: int = 512, budget: int = 256,
                    before: Callable[[httpx.AsyncClient, str, str, ScriptedPolicy], Awaitable[None]] | None = None,
                    run_stop: tuple[str, ...] = (),
                    ) -> tuple[httpx.Response, SessionRegistry, Any]:
    """One request (raw body bytes) to a fresh session's `path` on the gateway app in process;
    `before` may make calls of that session first. Returns the response, the registry, the session."""
    tok = build_tokenizer(tools=True)
    tok.chat_template = template_prefix + tok.chat_template
    policy = ScriptedPolicy(tok, turns)
    registry = SessionRegistry(tok, GatewayLimits(max_model_len=max_model_len, response_budget=budget,
                                                  max_staleness_versions=eta))
    g = registry.open_group("r/l", SamplingSpec(n=1, max_tokens=budget, stop=run_stop), policy.generate,
                            lambda: policy.version)
    (s,) = g.samples
    base = f"http://gw/sessions/{s.id}"
    app = build_app(registry)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False)) as c:
        if before is not None:
            await before(c, base, s.key, policy)
        r = await c.post(base + path, content=body,
                         headers={"Authorization": f"Bearer {s.key}", "Content-Type": "application/json"})
    return r, registry, s


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1' + b"0" * 400 + b"}",
     "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": -1' + b"0" * 400 + b"}", "top_p"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1' + b"0" * 5000 + b"}",
     "body"),
    ("/finish", b'{"reward": 1' + b"0" * 400 + b"}", "reward"),
])
def test_a_number_too_large_for_a_float_is_a_400_naming_its_field(path: str, body: bytes, param: str) -> None:
    r, registry, s = asyncio.run(_raw_call(path, body))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert s.state == "open" and registry.counters["calls"] == 0


@pytest.mark.parametrize("role", [["user"], {"r": "user"}], ids=["list", "object"])
def test_a_role_that_is_not_a_string_is_a_400_naming_it(role: object) -> None:
    """A list or object role is unhashable: the set lookup raised TypeError, answered as a 500 that
    the OpenAI SDKs retry, where it is a 400 naming messages[0].role."""
    body = json.dumps({"model": "m", "messages": [{"role": role, "content": "123+456="}]}).encode()
    r, registry, s = asyncio.run(_raw_call("/v1/chat/completions", body))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role", r.text
    assert s.state == "open" and registry.counters["calls"] == 0


def test_a_request_the_template_cannot_render_is_a_400_before_the_session_is_found_stale() -> None:
    """Validation comes before the session's state: a body with tools the chat template refuses is a
    400 naming tools, and the stale sample is not restarted by it (its next valid call is the 409)."""
    refuse = ("{%- for t in tools or [] %}{%- if t['function']['name'] == 'broken' %}"
              "{{- raise_exception('this template cannot render the tool broken') }}{%- endif %}{%- endfor %}")
    msgs = [{"role": "user", "content": "123+456="}]

    async def stale(c: httpx.AsyncClient, base: str, key: str, policy: ScriptedPolicy) -> None:
        r = await c.post(base + "/v1/chat/completions", json={"messages": msgs}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        policy.version = 1  # past max_staleness_versions=0

    body = json.dumps({"messages": msgs, "tools": [{"type": "function", "function": {"name": "broken"}}]}).encode()
    r, registry, s = asyncio.run(_raw_call("/v1/chat/completions", body, eta=0, template_prefix=refuse, before=stale))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert s.state == "open" and s.restart is None and registry.counters["rejected_stale"] == 0
    assert registry.stale_reason(s) is not None  # stale all along: a valid call would have been the 409


def test_an_over_long_text_completion_prompt_is_a_400_naming_prompt() -> None:
    """/completions has no `messages`: the context-length error names the field it has, `prompt`."""
    body = json.dumps({"model": "m", "prompt": "9" * 600}).encode()
    r, registry, s = asyncio.run(_raw_call("/v1/completions", body))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "prompt", r.text
    assert s.state == "open" and registry.counters["calls"] == 0


def test_a_call_cut_after_a_plain_lt_is_closed_by_the_end_of_turn_token_when_continued() -> None:
    """A call cut by its budget right after a plain `<` (the first character of `<|im_end|>`, not the
    token) is continued with the end-of-turn token itself: the stitched ids are the full render's."""
    first = [{"role": "user", "content": "123+456="}]
    msgs = [*first, {"role": "assistant", "content": "57<"}, {"role": "user", "content": "go on"}]

    async def cut(c: httpx.AsyncClient, base: str, key: str, policy: ScriptedPolicy) -> None:
        r = await c.post(base + "/v1/chat/completions", json={"messages": first}, headers={"Authorization": f"Bearer {key}"})
        assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["choices"][0]["message"]["content"] == "57<"

    r, registry, s = asyncio.run(_raw_call("/v1/chat/completions", json.dumps({"messages": msgs}).encode(),
                                           turns=["57<", ANSWER], before=cut))
    assert r.status_code == 200 and registry.counters["stitched_calls"] == 1, r.text
    (seg,) = s.segments
    full = ChatRenderer(registry.tok).prompt_ids(msgs)
    assert seg.prompt_ids + seg.traj.token_ids[: len(full) - len(seg.prompt_ids)] == full


@pytest.mark.parametrize("path", ["chat", "completion"])
def test_a_call_whose_group_ends_while_it_generates_is_409_and_not_recorded(path: str) -> None:
    """The group fails (another sample's deadline, a lost lease) while a call of this sample is
    generating: the call is answered 409 like any call after the end, and nothing is recorded in a
    session whose group is gone (the agent is not told its call went through)."""
    from services.rollout.gateway.openai_api import parse_chat, parse_completion

    async def main() -> tuple[Any, Any]:
        tok = build_tokenizer(tools=True)
        policy = ScriptedPolicy(tok, [ANSWER])
        gate = asyncio.Event()

        async def slow(req: GenerationRequest) -> list[SampleOutput]:
            await gate.wait()
            return await policy.generate(req)

        registry = SessionRegistry(tok, GatewayLimits(max_model_len=512, response_budget=256))
        g = registry.open_group("r/l", SamplingSpec(n=2, max_tokens=256), slow, lambda: 0)
        s = g.samples[0]
        call = (registry.chat(s, parse_chat({"messages": [{"role": "user", "content": "123+456="}]})) if path == "chat"
                else registry.complete(s, parse_completion({"prompt": "123+456="})))
        task = asyncio.ensure_future(call)
        await asyncio.sleep(0.05)
        g.fail("sample 1 passed agent.sample_timeout_s")
        registry.close_group(g)
        gate.set()
        return (await asyncio.gather(task, return_exceptions=True))[0], s

    result, s = asyncio.run(main())
    assert isinstance(result, ApiError) and result.status == 409, result
    assert s.segments == [] and s.calls == 0


def test_null_is_absent_for_the_optional_fields_openai_marks_nullable() -> None:
    """OpenAI's schema allows null for n, stream, logprobs, stream_options, top_logprobs, max_tokens,
    temperature, top_p and stop (clients that serialize every field send it): the call goes through."""
    nulls = dict.fromkeys(["n", "stream", "logprobs", "stream_options", "top_logprobs", "max_tokens",
                           "max_completion_tokens", "temperature", "top_p", "stop"])
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "123+456="}], **nulls}).encode()
    r, registry, _ = asyncio.run(_raw_call("/v1/chat/completions", body))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "579" and r.json()["choices"][0]["logprobs"] is None
    assert registry.counters["calls"] == 1
    body = json.dumps({"model": "m", "prompt": "123+456=", **nulls}).encode()
    r, _, _ = asyncio.run(_raw_call("/v1/completions", body))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "579", r.text


def test_a_chat_call_with_tool_choice_null_is_answered_as_without_it() -> None:
    """OpenAI's schema makes tool_choice (and tools) nullable, and clients that serialize every
    field send `"tool_choice": null`: it was a 400, so such an agent could make no call at all."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "123+456="}], "tools": TOOLS,
                       "tool_choice": None}).encode()
    r, _, _ = asyncio.run(_raw_call("/v1/chat/completions", body, turns=(CALL,)))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"  # null is absent: auto, calls parsed
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "123+456="}], "tools": None,
                       "tool_choice": None}).encode()
    r, _, _ = asyncio.run(_raw_call("/v1/chat/completions", body))
    assert r.status_code == 200, r.text


def test_echoed_tool_arguments_with_an_integer_past_the_digit_limit_are_compared_as_given() -> None:
    """Stitching compares an echoed call's arguments as parsed JSON where they parse; an integer
    past Python's digit limit does not (a ValueError), so they are compared as given and the call
    goes on to its checks (here the context's: those 5000 digits are rendered), not a 500."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "123+456="}]

    async def first(c: httpx.AsyncClient, base: str, key: str, policy: ScriptedPolicy) -> None:
        r = await c.post(base + "/v1/chat/completions", json={"messages": msgs}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text

    huge = '{"a": 1' + "0" * 5000 + "}"
    echo = {"role": "assistant", "content": "579",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "add", "arguments": huge}}]}
    body = json.dumps({"messages": [*msgs, echo, {"role": "tool", "tool_call_id": "c0", "content": "1"}]}).encode()
    r, registry, s = asyncio.run(_raw_call("/v1/chat/completions", body, before=first))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert registry.counters["calls"] == 1 and len(s.segments) == 1


def test_a_reply_that_fails_while_being_answered_leaves_the_session_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """A completion whose answer fails after generation (here the tool-call parser, made to raise
    once) fails the call with a 500 before anything is recorded: the client's retry of the same
    messages is the sample's first call (its context is not the failed completion plus those
    messages again)."""
    from services.rollout.gateway import sessions

    real = sessions.parse_tool_calls
    raised: list[str] = []

    def parse_once_broken(text: str, turn: int = 0) -> Any:
        if not raised:
            raised.append(text)
            raise RuntimeError("parser failure")
        return real(text, turn)

    monkeypatch.setattr(sessions, "parse_tool_calls", parse_once_broken)
    msgs = [{"role": "user", "content": "123+456="}]
    failed: list[int] = []

    async def fails_first(c: httpx.AsyncClient, base: str, key: str, policy: ScriptedPolicy) -> None:
        r = await c.post(base + "/v1/chat/completions", json={"messages": msgs, "tools": TOOLS},
                         headers={"Authorization": f"Bearer {key}"})
        failed.append(r.status_code)

    body = json.dumps({"messages": msgs, "tools": TOOLS}).encode()
    r, registry, s = asyncio.run(_raw_call("/v1/chat/completions", body, turns=[CALL, ANSWER], max_model_len=8192,
                                           budget=8000, before=fails_first))
    assert failed == [500] and r.status_code == 200, r.text
    (seg,) = s.segments
    answer = list(registry.tok.encode(ANSWER, add_special_tokens=False))
    assert seg.traj.token_ids == answer and seg.traj.loss_mask == [1] * len(answer)
    assert s.calls == 1 and registry.counters["calls"] == 1 and registry.counters["stitched_calls"] == 0


@pytest.mark.parametrize(("method", "path", "status"), [
    ("POST", "/v1/chat/completions", 404),  # a base URL without the session's prefix
    ("GET", "/sessions/abc/v1/models/m", 404),
    ("GET", "/sessions/abc/v1/chat/completions", 405),
])
def test_a_path_or_method_not_served_is_an_openai_error_that_names_what_is(method: str, path: str, status: int) -> None:
    tok = build_tokenizer(tools=True)
    app = build_app(SessionRegistry(tok, GatewayLimits(max_model_len=64, response_budget=32)))

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as c:
            return await c.request(method, "http://gw" + path)

    r = asyncio.run(main())
    assert r.status_code == status
    assert "/sessions/<id>/v1" in r.json()["error"]["message"] and r.json()["error"]["type"], r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_stops_at_the_runs_stop_strings_and_at_its_own(path: str, stream: bool) -> None:
    """`stop` in a request adds to `actor_rollout_ref.rollout.stop`: the engine gets both."""
    seen: list[ScriptedPolicy] = []

    async def keep(c: httpx.AsyncClient, base: str, key: str, policy: ScriptedPolicy) -> None:
        seen.append(policy)

    what = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    for stop in (["\nObservation:", "</answer>"], None):
        body = json.dumps({**what, "stop": stop, "stream": stream}).encode()
        r, _, _ = asyncio.run(_raw_call(path, body, run_stop=("</answer>",), before=keep))
        assert r.status_code == 200, r.text
        (req,) = seen.pop().requests
        assert req.sampling.stop == (("</answer>", "\nObservation:") if stop else ("</answer>",)), req.sampling


def test_a_group_whose_samples_share_no_prompt_token_fails_with_the_fix_instead_of_reaching_the_trainer() -> None:
    """Agents whose /v1/completions prompts differ from the first character (a per-sample id or
    few-shot pick up front) made a group with an empty prompt: the coordinator took it and the
    trainer, which cannot train a sequence without a prompt token, stopped the run (and the group
    came back after a restart). The group now fails here, saying what to change, and the
    coordinator refuses an empty prompt from any rollout."""
    from meshrl.v1 import coordinator_pb2
    from services.common.errors import InvalidArgument
    from services.coordinator.convert import groups_from_request

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        text = "Compute 123+456=" if prompt["sample_index"] == 0 else "What is 123+456? "
        async with httpx.AsyncClient() as c:
            r = await c.post(url + "/completions", json={"model": "m", "prompt": text},
                             headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        assert (await finish(url, key, {"reward": 1.0})).status_code == 200

    result, ga, _ = asyncio.run(play(agent, [ANSWER], n=2))
    assert isinstance(result, GatewayGroupFailed) and "share no leading token" in str(result), result
    assert ga.counters["groups_failed"] == 1

    group = common_pb2.TrajectoryGroup(lease_id="lease-1", prompt=PROMPT, responses=[
        common_pb2.Response(token_ids=[5, 6], logprobs=[-0.1, -0.2], versions=[0, 0]) for _ in range(2)])
    with pytest.raises(InvalidArgument, match=r"groups\[0\]\.prompt_token_ids"):
        groups_from_request(coordinator_pb2.SubmitGroupsRequest(replica_id="rep", groups=[group]),
                            max_groups=8, max_tokens=1 << 20, expected_n=2)


_SPAWNS_A_HELPER = textwrap.dedent("""
    import json, subprocess, sys, openai
    prompt = json.load(sys.stdin)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a tool server, say
    open(sys.argv[1] + f"/child{prompt['sample_index']}", "w").write(str(child.pid))
    openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=prompt["messages"])
    sys.exit(3 if sys.argv[2] == "crash" else 0)
""")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("ending", ["exit0", "crash"])
def test_what_an_agent_program_started_ends_with_it(tmp_path: Path, ending: str) -> None:
    """The agent's own processes were killed only at a deadline or cancellation: after a normal
    exit or a crash its children (tool servers, sandboxes) kept running, holding the replica's
    resources, for as long as the replica lived."""
    prog = tmp_path / "agent.py"
    prog.write_text(_SPAWNS_A_HELPER)
    try:
        result, _, _ = asyncio.run(play(None, [ANSWER], n=2, command=[sys.executable, str(prog), str(tmp_path), ending]))
        assert isinstance(result, common_pb2.TrajectoryGroup if ending == "exit0" else GatewayGroupFailed), result
    finally:
        # (after a crash the group fails and the other sample may be stopped before it starts one)
        pids = [int((tmp_path / f"child{i}").read_text()) for i in range(2) if (tmp_path / f"child{i}").exists()]
        alive = [p for p in pids if _alive(p)]
        for p in alive:
            os.kill(p, signal.SIGKILL)
    assert pids and not alive, f"the agent's children outlived it: {alive}"


@pytest.mark.parametrize("rc", [0, 5])
def test_an_agent_whose_detached_child_holds_its_stderr_ends_when_it_exits(tmp_path: Path, rc: int) -> None:
    """A process the agent started in a session of its own (a tool server under setsid) keeps the
    stderr pipe open after the agent exits and is out of reach of the group kill. An agent that
    exits 0 is done then (it used to wait a second more for the pipe, and an agent exiting within
    a second of its deadline was failed as late); a failed one still reports its stderr's tail."""
    pid_file = tmp_path / "child.pid"
    script = f"setsid sh -c 'echo $$ > {pid_file}; exec sleep 30' & sleep 0.2; echo the last words >&2; exit {rc}"

    async def main() -> Any:
        tok = build_tokenizer(tools=True)
        registry = SessionRegistry(tok, GatewayLimits(max_model_len=512, response_budget=256))

        async def generate(*_a: Any, **_k: Any) -> Any:
            raise AssertionError("the agent calls no model")

        g = registry.open_group("r/l", SamplingSpec(n=1, max_tokens=10), generate, lambda: 0)
        (s,) = g.samples
        agent = GatewayAgent(tok, registry, GatewaySettings(
            command=("bash", "-c", script), endpoint=None, sample_timeout_s=1.0, max_concurrent=1, launch=None,
            secret_env=frozenset()))
        agent.base_url = lambda sid: "http://127.0.0.1:9/v1"
        return await agent._run_sample(s, PROMPT), agent.counters

    try:
        out, counters = asyncio.run(main())
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert counters["deadlines"] == 0, out
    if rc == 0:
        assert out.ok, out
    else:
        assert not out.ok and f"exited with {rc}" in out.error and "the last words" in out.error, out


@pytest.mark.parametrize(("budget", "clipped"), [(120, True), (100, False)])
def test_a_history_that_starts_a_new_segment_does_not_reset_the_response_budget(budget: int, clipped: bool) -> None:
    """An agent that keeps its own copy of the turns (here: the answers elided) starts a new segment
    at every call, and that segment's prompt holds the whole history so far. The budget counts after
    the sample's first prompt (GatewayLimits.response_budget), so those turns spend it: the call is
    clipped to what is left, the next one is refused, and the response is no longer than the
    budget, as in the in-process loop."""
    # each call adds 53 tokens to the history (the tiny tokenizer): with 120 the third call is clipped
    # to what is left, with 100 it is refused
    refused: list[str | None] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        messages = list(prompt["messages"])
        for _ in range(8):
            try:
                await c.chat.completions.create(model="m", messages=messages)
            except openai.BadRequestError as exc:
                refused.append(exc.code)
                break
            # the agent's own record of the turn, not the reply: no stitch, a new segment each call
            messages += [{"role": "assistant", "content": f"(answer of sample {prompt['sample_index']} elided)"},
                         {"role": "user", "content": "again"}]
        await c.close()
        await finish(url, key, {"reward": 0.0})

    long_answer = "5" * 30 + "<|im_end|>"
    group, ga, policy = asyncio.run(play(agent, [long_answer], n=2, budget=budget))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert ga.registry.counters["stitch_mismatches"] > 0
    for r in group.responses:
        assert len(r.token_ids) <= budget, (len(r.token_ids), budget)
        policy_ids = [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if m]
        assert (0 < len(policy_ids) < len(policy.turns[0])) is clipped
        assert r.finish_reason == common_pb2.FINISH_REASON_LENGTH  # cut by the budget either way
    assert refused == ["context_length_exceeded"] * 2


@pytest.mark.parametrize("limit", ["budget", "context"])
def test_a_sample_refused_for_its_budget_or_context_ends_with_length(limit: str) -> None:
    """A tool result that does not fit the response budget (or the model's context) refuses the
    call that would append it (400 context_length_exceeded, nothing recorded); the trajectory ends
    there, truncated, so it finishes with `length` as in the in-process loop (verl: what does not
    fit is not appended) and the reward service is told it was truncated, not `stop` of the turn
    before."""
    refused: list[str | None] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        messages = list(prompt["messages"])
        resp = await c.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        msg = resp.choices[0].message.model_dump(exclude_none=True)
        messages += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "9" * 300}]
        try:
            await c.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        except openai.BadRequestError as exc:
            refused.append(exc.code)
        await c.close()
        await finish(url, key, {"reward": 0.0})

    kw = {"budget": 128, "max_model_len": 1024} if limit == "budget" else {"budget": 1024, "max_model_len": 256}
    group, _, _ = asyncio.run(play(agent, [CALL, ANSWER], n=1, **kw))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert refused == ["context_length_exceeded"]
    (r,) = group.responses
    assert r.num_turns == 1 and r.finish_reason == common_pb2.FINISH_REASON_LENGTH
