"""The gateway in front of a real engine: the transformers engine with the tiny Qwen3 (random
weights, the tool tokenizer), its HTTP server on loopback, and the official `openai` SDK as the
agent, making several chat calls per sample (one streamed, with logprobs). What the engine
sampled is exactly what the trajectory holds: each call continues from the previous call's ids,
the logprobs the SDK saw are the trajectory's, and between two calls lie exactly the tokens of
the agent's new messages (the chat template's delta), masked. No Ray."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import httpx
import openai
import torch

from meshrl.v1 import common_pb2
from services.common.tiny import build_tiny_model, build_tokenizer
from services.rollout.agent.chat import ChatRenderer
from services.rollout.engines.base import GenerationRequest, SampleOutput, SamplingSpec
from services.rollout.engines.transformers_engine import TransformersEngine
from services.rollout.gateway import GatewayAgent, GatewayLimits, GatewaySettings, SessionRegistry
from services.rollout.gateway.app import GatewayServer, build_app


def test_sdk_calls_on_a_real_engine_are_recorded_token_for_token() -> None:
    torch.manual_seed(0)
    tok = build_tokenizer(tools=True)
    model = build_tiny_model("qwen3", tok, seed=0)
    seen: dict[int, list[list[float]]] = {}
    requests: list[GenerationRequest] = []

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        messages: list[Any] = list(prompt["messages"])
        lps: list[list[float]] = []
        for turn in range(3):
            if turn == 1:  # streamed
                content, chunk_lps = "", []
                async for ch in await client.chat.completions.create(model="m", messages=messages, max_tokens=12,
                                                                    stream=True, logprobs=True):
                    if ch.choices and ch.choices[0].delta.content:
                        content += ch.choices[0].delta.content
                    if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content:
                        chunk_lps += [x.logprob for x in ch.choices[0].logprobs.content]
                lps.append(chunk_lps)
                messages.append({"role": "assistant", "content": content})
            else:
                resp = await client.chat.completions.create(model="m", messages=messages, max_tokens=12, logprobs=True)
                assert resp.usage is not None and resp.usage.completion_tokens == len(resp.choices[0].logprobs.content)
                lps.append([x.logprob for x in resp.choices[0].logprobs.content])
                messages.append(resp.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": f"go on {turn}"})
        seen[prompt["sample_index"]] = lps
        await client.close()
        async with httpx.AsyncClient() as c:
            (await c.post(url.rsplit("/v1", 1)[0] + "/finish", json={"reward": 0.5},
                          headers={"Authorization": f"Bearer {key}"})).raise_for_status()

    async def main() -> tuple[common_pb2.TrajectoryGroup, GatewayAgent]:
        engine = TransformersEngine(model, tok, max_num_seqs=8, max_model_len=512, seed=0)
        await engine.start()

        async def generate(req: GenerationRequest) -> list[SampleOutput]:
            requests.append(req)
            return await engine.generate(req)

        registry = SessionRegistry(tok, GatewayLimits(max_model_len=512, response_budget=400))
        ga = GatewayAgent(tok, registry, GatewaySettings(command=None, endpoint=None, sample_timeout_s=120,
                                                         max_concurrent=4, launch=agent))
        server = GatewayServer(build_app(registry), "127.0.0.1", 0)
        port = await server.start()
        ga.base_url = lambda sid: f"http://127.0.0.1:{port}/sessions/{sid}/v1"
        prompt = common_pb2.Prompt(prompt_id="p", messages=[common_pb2.ChatMessage(role="user", content="12+34=")])
        try:
            group = await ga.play(prompt, SamplingSpec(n=2, max_tokens=400), "r/l", "l", "r", generate,
                                  cancelled=lambda: False, version=lambda: engine.version)
        finally:
            await server.stop()
            await engine.close()
        return group, ga

    group, ga = asyncio.run(main())
    assert [r.env_reward for r in group.responses] == [0.5, 0.5]
    assert ga.registry.counters["stitch_mismatches"] == 0 and ga.registry.counters["stitched_calls"] == 4
    renderer = ChatRenderer(tok)
    for r in group.responses:
        ids, mask = list(r.token_ids), list(r.loss_mask)
        starts = [*r.turn_starts, len(ids)]
        policy_runs = [(a, b) for a, b in itertools.pairwise(starts) if mask[a]]
        assert len(policy_runs) == 3 and r.num_turns == 3
        # the logprobs the SDK saw (streamed or not) are the trajectory's, call by call
        assert [[round(x, 4) for x in r.logprobs[a:b]] for a, b in policy_runs] == \
            [[round(x, 4) for x in lp] for lp in seen[r.sample_index]]
        assert all(v == 0 for v, m in zip(r.versions, mask, strict=True) if m)
        assert all(v == -1 for v, m in zip(r.versions, mask, strict=True) if not m)
        # each engine call continued from the exact ids so far
        mine = [q for q in requests if f"/{r.sample_index}/c" in q.request_id]
        full = list(group.prompt_token_ids) + ids
        for (a, _), q in zip(policy_runs, mine, strict=True):
            assert q.prompt_token_ids == full[: len(group.prompt_token_ids) + a]
        # between the calls: exactly the agent's new message (the assistant turn closed, the user
        # turn, the next generation prompt), masked; a random policy's text may hold special
        # tokens, so a full re-tokenization of its decoded text would not round-trip (hence deltas)
        for k in range(2):
            a, b = policy_runs[k][1], policy_runs[k + 1][0]
            expected = renderer.tail(tok.decode(ids[a - 1 : a], skip_special_tokens=False)) + \
                f"<|im_start|>user\ngo on {k}<|im_end|>\n<|im_start|>assistant\n"
            assert tok.decode(ids[a:b], skip_special_tokens=False) == expected
            assert ids[a:b] == renderer.encode(expected) and not any(mask[a:b])
