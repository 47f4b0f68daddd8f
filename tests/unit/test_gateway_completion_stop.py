"""A text completion cut at a stop string is returned without it (OpenAI's, vLLM's contract); an
agent that continues from what it was returned (the prompt, the returned text, then its own) still
extends the sample's token sequence, as a chat call's echo of the cut content does, where it
started a new segment each call and the sample trained on its last call only."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from meshrl.v1 import common_pb2
from tests.unit.test_gateway import finish, play


def test_a_completion_continued_from_its_text_without_the_stop_string_is_stitched() -> None:
    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        r1 = await c.completions.create(model="m", prompt="123+456=", max_tokens=8, stop=["\n"])
        assert r1.choices[0].text == "579", r1
        await c.completions.create(model="m", prompt="123+456=" + r1.choices[0].text + " so", max_tokens=8)
        await c.close()
        await finish(url, key, {"reward": 1.0})

    group, ga, policy = asyncio.run(play(agent, ["579\n<|im_end|>", "!"], n=1))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    assert ga.registry.counters["stitch_mismatches"] == 0 and ga.registry.counters["stitched_calls"] == 1
    (r,) = group.responses
    # the policy's tokens of both calls are trained, its stop string included (what it sampled)
    assert policy.tok.decode(list(r.token_ids), skip_special_tokens=False) == "579\n<|im_end|> so!"
    assert list(r.loss_mask) == [1] * 5 + [0] * 3 + [1]
