"""Token-by-token streaming through the gateway, without a model: the scripted policy of
test_gateway.py, now streaming (it hands every token to the request's on_token before returning,
yielding to the event loop between tokens as an engine thread would). The official SDK's stream
iterator sees the content in several chunks, tool calls as delta.tool_calls at the end, usage in the
last chunk; what it saw equals the non-streamed answer, and the held-back rules (safe_text) keep a
tool block, a stop string's start and trailing whitespace out of the content until the end."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from meshrl.v1 import common_pb2
from services.common.tiny import build_tokenizer
from services.rollout.engines.base import GenerationRequest, SampleOutput
from services.rollout.gateway.streaming import safe_text
from tests.unit.test_gateway import ANSWER, CALL, TOOLS, ScriptedPolicy, finish, play


class StreamingPolicy(ScriptedPolicy):
    async def generate(self, req: GenerationRequest) -> list[SampleOutput]:
        (out,) = await super().generate(req)
        for t, lp in zip(out.token_ids, out.logprobs, strict=True):
            if req.on_token is not None:
                req.on_token(0, t, lp)
            await asyncio.sleep(0.005)
        return [out]


def test_safe_text_holds_back_what_the_final_content_may_not_start_with() -> None:
    assert safe_text("12 ", tools=False, stop=()) == "12"
    assert safe_text("ab\ufffd", tools=False, stop=()) == "ab"
    assert safe_text("hello wor", tools=False, stop=("world",)) == "hello"  # " wor" may begin "world"
    assert safe_text("hello. END more", tools=False, stop=("END",)) == "hello."
    assert safe_text("  sum: <tool_call>{", tools=True, stop=()) == "sum:"
    assert safe_text("sum <tool_", tools=True, stop=()) == "sum"


def test_a_stream_goes_out_token_by_token_and_ends_with_tool_calls_and_usage() -> None:
    got: list[dict[str, Any]] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        messages: list[Any] = list(prompt["messages"])
        for _ in range(2):
            content, lps, calls, usage, reason, content_chunks = "", [], {}, None, None, 0
            async for ch in await c.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                                            logprobs=True, stream_options={"include_usage": True}):
                usage = ch.usage or usage
                for choice in ch.choices:
                    if choice.delta.content:
                        content += choice.delta.content
                        content_chunks += 1
                    if choice.logprobs and choice.logprobs.content:
                        lps += [(x.token, x.logprob) for x in choice.logprobs.content]
                    for tc in choice.delta.tool_calls or []:
                        assert tc.function is not None
                        calls[tc.index] = {"id": tc.id, "type": "function",
                                           "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                    reason = choice.finish_reason or reason
            got.append({"content": content, "lps": lps, "calls": calls, "usage": usage, "reason": reason,
                        "content_chunks": content_chunks})
            msg: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                msg["tool_calls"] = [calls[k] for k in sorted(calls)]
            messages.append(msg)
            if calls:
                messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "579"})
        await c.close()
        assert (await finish(url, key, {"reward": 1.0})).status_code == 200

    from services.common.tiny import build_tokenizer

    tok = build_tokenizer(tools=True)
    policy = StreamingPolicy(tok, [CALL, ANSWER])
    group, ga, _ = asyncio.run(play(agent, [CALL, ANSWER], n=1, policy=policy))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    call, answer = got
    # the tool call: no content streamed, the call as delta.tool_calls, finish tool_calls
    assert call["content"] == "" and call["reason"] == "tool_calls"
    assert call["calls"][0]["function"]["name"] == "add"
    # the answer: content in several chunks (token by token), equal to the non-streamed content
    assert answer["content"] == "579" and answer["content_chunks"] >= 2 and answer["reason"] == "stop"
    (r,) = group.responses
    for g, ids in zip(got, policy.turns, strict=True):
        # the chunks' tokens are the recorded completion, token for token
        assert [t for t, _ in g["lps"]] == [tok.decode([i], skip_special_tokens=False) for i in ids]
        assert g["usage"].completion_tokens == len(ids)
    assert r.tool_calls == 1 and r.final_text == "579" and r.env_reward == 1.0
    assert ga.registry.counters["stitch_mismatches"] == 0 and ga.registry.counters.get("stream_content_diverged", 0) == 0


def test_a_streamed_text_completion_carries_its_tokens_logprobs_and_offsets() -> None:
    """`/v1/completions` with `stream` and `logprobs: 1`: each chunk carries its tokens' logprobs in
    the legacy completions shape, and together they equal the recorded completion, token for token."""
    got: dict[str, Any] = {}

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        text, tokens, lps, offsets, chunks = "", [], [], [], 0
        async for ch in await c.completions.create(model="m", prompt="123+456=", max_tokens=16, logprobs=1, stream=True):
            for choice in ch.choices:
                text += choice.text
                if choice.logprobs is not None and choice.logprobs.tokens:
                    chunks += 1
                    tokens += choice.logprobs.tokens
                    lps += choice.logprobs.token_logprobs or []
                    offsets += choice.logprobs.text_offset or []
        got.update(text=text, tokens=tokens, lps=lps, offsets=offsets, chunks=chunks)
        await c.close()
        await finish(url, key, {"reward": 1.0})

    policy = StreamingPolicy(build_tokenizer(tools=True), ["579 is it"])
    group, _, _ = asyncio.run(play(agent, ["579 is it"], n=1, policy=policy))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    (r,) = group.responses
    want = [str(policy.tok.decode([t], skip_special_tokens=False)) for t in r.token_ids]
    assert got["text"] == "579 is it" and got["tokens"] == want and got["chunks"] > 1, got
    assert got["lps"] == [-0.5] * len(want) == list(r.logprobs), got
    assert got["offsets"] == [sum(len(s) for s in want[:k]) for k in range(len(want))], got


def test_concurrent_calls_on_one_session_get_distinct_response_ids() -> None:
    """A stream's chunks carry its id before its call holds the session's lock: two streams
    started together, and a plain call after them, still carry three different ids."""
    ids: list[set[str]] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)

        async def streamed() -> None:
            seen = {ch.id async for ch in await c.chat.completions.create(model="m", messages=prompt["messages"],
                                                                       stream=True)}
            ids.append(seen)

        await asyncio.gather(streamed(), streamed())
        plain = await c.chat.completions.create(model="m", messages=prompt["messages"])
        ids.append({plain.id})
        await c.close()
        assert (await finish(url, key, {"reward": 1.0})).status_code == 200

    tok = build_tokenizer(tools=True)
    policy = StreamingPolicy(tok, [ANSWER, ANSWER, ANSWER])
    group, _, _ = asyncio.run(play(agent, [ANSWER, ANSWER, ANSWER], n=1, policy=policy))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert [len(s) for s in ids] == [1, 1, 1], ids  # one id per response, on every chunk
    assert len(set().union(*ids)) == 3, ids
