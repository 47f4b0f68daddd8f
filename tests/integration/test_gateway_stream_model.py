"""Streaming on a real engine: the transformers engine with the tiny Qwen3 (random weights), the
gateway on loopback, the official `openai` SDK's stream iterator. The engine is paused right after
it samples the call's first token and resumed only once the agent holds its first chunk, so the
first chunk demonstrably left before the last token was decoded (a stream assembled after the
completion could not arrive while the engine is paused). The stream's tokens and logprobs are the
recorded completion, token for token, its content is the completion's text, usage comes last, and
the next (non-streamed) call stitches onto it. No Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Any

import httpx
import openai
import torch

from meshrl.v1 import common_pb2
from services.common.tiny import build_tiny_model, build_tokenizer
from services.rollout.engines.base import GenerationRequest, SampleOutput, SamplingSpec
from services.rollout.engines.transformers_engine import TransformersEngine
from services.rollout.gateway import GatewayAgent, GatewayLimits, GatewaySettings, SessionRegistry
from services.rollout.gateway.app import GatewayServer, build_app


def test_a_stream_leaves_before_the_last_token_is_decoded_and_equals_the_recording() -> None:
    torch.manual_seed(0)
    tok = build_tokenizer(tools=True)
    model = build_tiny_model("qwen3", tok, seed=0)
    decoded: list[int] = []  # token ids of the streamed call, as the engine hands them out
    got: dict[str, Any] = {}

    async def main() -> common_pb2.TrajectoryGroup:
        engine = TransformersEngine(model, tok, max_num_seqs=2, max_model_len=512, seed=0)
        await engine.start()
        paused: list[asyncio.Task[None]] = []

        async def generate(req: GenerationRequest) -> list[SampleOutput]:
            hook = req.on_token
            if hook is None:
                return await engine.generate(req)

            def on_token(i: int, t: int, lp: float) -> None:
                decoded.append(t)
                if not paused:  # first token: hold the engine until the agent has a chunk
                    paused.append(asyncio.get_running_loop().create_task(engine.pause("keep")))
                hook(i, t, lp)

            return await engine.generate(dataclasses.replace(req, on_token=on_token))

        async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
            client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
            messages: list[Any] = list(prompt["messages"])
            content, tokens, usage, chunks = "", [], None, 0
            async for ch in await client.chat.completions.create(
                    model="m", messages=messages, max_tokens=200, stream=True, logprobs=True,
                    stream_options={"include_usage": True}):
                usage = ch.usage or usage
                for choice in ch.choices:
                    content += choice.delta.content or ""
                    if choice.logprobs and choice.logprobs.content:
                        if "decoded_at_first_chunk" not in got:
                            got["decoded_at_first_chunk"] = len(decoded)
                            await paused[0]
                            await engine.resume()
                        chunks += 1
                        tokens += [(x.token, x.logprob) for x in choice.logprobs.content]
            got.update(content=content, tokens=tokens, usage=usage, chunks=chunks)
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "go on"}]
            resp = await client.chat.completions.create(model="m", messages=messages, max_tokens=8)
            got["second_tokens"] = resp.usage.completion_tokens if resp.usage else -1
            await client.close()
            async with httpx.AsyncClient() as c:
                (await c.post(url.rsplit("/v1", 1)[0] + "/finish", json={"reward": 1.0},
                              headers={"Authorization": f"Bearer {key}"})).raise_for_status()

        registry = SessionRegistry(tok, GatewayLimits(max_model_len=512, response_budget=400))
        ga = GatewayAgent(tok, registry, GatewaySettings(command=None, endpoint=None, sample_timeout_s=120,
                                                         max_concurrent=1, launch=agent))
        server = GatewayServer(build_app(registry), "127.0.0.1", 0)
        port = await server.start()
        ga.base_url = lambda sid: f"http://127.0.0.1:{port}/sessions/{sid}/v1"
        prompt = common_pb2.Prompt(prompt_id="p", messages=[common_pb2.ChatMessage(role="user", content="12+34=")])
        try:
            group = await ga.play(prompt, SamplingSpec(n=1, max_tokens=400), "r/l", "l", "r", generate,
                                  cancelled=lambda: False, version=lambda: engine.version)
        finally:
            await server.stop()
            await engine.close()
        assert registry.counters["stitched_calls"] == 1 and registry.counters["stitch_mismatches"] == 0
        return group

    group = asyncio.run(main())
    (r,) = group.responses
    starts = [*r.turn_starts, len(r.token_ids)]
    (a, b), _ = [(x, y) for x, y in itertools.pairwise(starts) if r.loss_mask[x]]
    recorded = list(r.token_ids[a:b])
    assert decoded == recorded and len(recorded) > 1
    # the first chunk reached the agent while the engine had sampled only part of the completion
    assert got["decoded_at_first_chunk"] < len(recorded) and got["chunks"] > 1
    # the stream is the recording, token for token
    assert [t for t, _ in got["tokens"]] == [tok.decode([t], skip_special_tokens=False) for t in recorded]
    assert [round(x, 4) for _, x in got["tokens"]] == [round(x, 4) for x in r.logprobs[a:b]]
    assert got["content"] == tok.decode(recorded, skip_special_tokens=True)
    assert got["usage"].completion_tokens == len(recorded) and got["second_tokens"] >= 1
