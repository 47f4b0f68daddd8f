"""The gateway holds a sample's first prompt to data.max_prompt_length as the in-process agent loop
and the single-turn path do: over it, data.truncation=error answers an OpenAI 400 naming the limit
(nothing recorded), left / right / middle truncate it as they do."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from services.common.config import MeshConfig
from services.common.tiny import build_tokenizer
from services.rollout.engines.base import SamplingSpec
from services.rollout.gateway import build_gateway_agent
from services.rollout.gateway.app import build_app
from tests.unit.test_gateway import ANSWER, ScriptedPolicy

LONG = [{"role": "user", "content": "1 2 3 4 5 6 7 8 9 " * 8 + "123+456="}]


async def _first_call(truncation: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, Any, ScriptedPolicy]:
    cfg = MeshConfig.model_validate({"data": {"max_prompt_length": 16, "max_response_length": 64,
                                              "truncation": truncation}})
    tok = build_tokenizer(tools=True)
    agent = build_gateway_agent(cfg, tok, scorer=None, max_model_len=512)
    policy = ScriptedPolicy(tok, [ANSWER])
    g = agent.registry.open_group("r/l", SamplingSpec(n=1, max_tokens=64), policy.generate, lambda: 0)
    (s,) = g.samples
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(agent.registry),
                                                               raise_app_exceptions=False)) as c:
        r = await c.post(f"http://gw/sessions/{s.id}{path}", content=json.dumps(body).encode(),
                         headers={"Authorization": f"Bearer {s.key}", "Content-Type": "application/json"})
    return r, s, policy


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": LONG}, "messages"),
    ("/v1/completions", {"prompt": LONG[0]["content"]}, "prompt"),
])
def test_a_first_prompt_over_max_prompt_length_is_a_400_naming_it(path: str, body: dict[str, Any], param: str) -> None:
    r, s, policy = asyncio.run(_first_call("error", path, body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "data.max_prompt_length=16" in err["message"], err
    assert not s.segments and s.calls == 0 and s.state == "open" and not policy.requests


@pytest.mark.parametrize("truncation", ["left", "right", "middle"])
def test_a_first_prompt_over_max_prompt_length_is_truncated_as_data_truncation_says(truncation: str) -> None:
    r, s, policy = asyncio.run(_first_call(truncation, "/v1/chat/completions", {"messages": LONG}))
    assert r.status_code == 200, r.text
    (seg,) = s.segments
    assert len(seg.prompt_ids) == 16 and list(policy.requests[0].prompt_token_ids) == seg.prompt_ids
    assert r.json()["usage"]["prompt_tokens"] == 16


def test_a_group_whose_agent_was_refused_every_call_says_why() -> None:
    """An agent that catches the 400 on its only call and exits 0 leaves its sample without a
    recorded call: the group fails, and its error carries the refusal (the limit to raise), not
    only "finished without calling the model", which it did."""
    import openai

    from services.rollout.gateway import GatewayGroupFailed
    from tests.unit.test_gateway import play

    async def agent(url: str, key: str, prompt: dict[str, Any]) -> None:
        c = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model="m", messages=LONG)
        await c.close()

    group, _, _ = asyncio.run(play(agent, [ANSWER], n=1, max_model_len=64))
    assert isinstance(group, GatewayGroupFailed), group
    assert "without calling the model" not in str(group) and "the model's context is 64 tokens" in str(group), group
