"""The gateway answers a bad body (400) before the session's state (409: stale, ended), as app.py
orders them, a text completion's logprobs=0 still carries the sampled tokens' logprobs, and the
renderer cache is bounded in bytes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from tests.unit.test_gateway import ScriptedPolicy, _raw_call

MSGS = [{"role": "user", "content": "123+456="}]


async def _stale(c: httpx.AsyncClient, base: str, key: str, policy: ScriptedPolicy) -> None:
    r = await c.post(base + "/v1/chat/completions", json={"messages": MSGS}, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    policy.version = 1  # past max_staleness_versions=0


async def _stale_completion(c: httpx.AsyncClient, base: str, key: str, policy: ScriptedPolicy) -> None:
    r = await c.post(base + "/v1/completions", json={"prompt": "123+456="}, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    policy.version = 1


def test_an_over_long_chat_request_is_a_400_before_the_session_is_found_stale() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "9" * 600}]}).encode()
    r, registry, s = asyncio.run(_raw_call("/v1/chat/completions", body, eta=0, before=_stale))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert s.state == "open" and s.restart is None and registry.counters["rejected_stale"] == 0


def test_an_over_long_text_completion_is_a_400_before_the_session_is_found_stale() -> None:
    body = json.dumps({"prompt": "9" * 600}).encode()
    r, registry, s = asyncio.run(_raw_call("/v1/completions", body, eta=0, before=_stale_completion))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert s.state == "open" and s.restart is None and registry.counters["rejected_stale"] == 0


def test_a_bad_body_to_an_ended_session_is_a_400_before_its_state() -> None:
    """app.py's order: the key (401), the body (400 naming the field), then the session's state (409)
    also for a session whose group has ended; a valid body is the 409."""
    from services.common.tiny import build_tokenizer
    from services.rollout.engines.base import SamplingSpec
    from services.rollout.gateway import GatewayLimits, SessionRegistry
    from services.rollout.gateway.app import build_app

    async def main() -> list[tuple[int, Any]]:
        tok = build_tokenizer(tools=True)
        policy = ScriptedPolicy(tok, ["579<|im_end|>"])
        registry = SessionRegistry(tok, GatewayLimits(max_model_len=512, response_budget=256))
        g = registry.open_group("r/l", SamplingSpec(n=1, max_tokens=256), policy.generate, lambda: 0)
        (s,) = g.samples
        registry.close_group(g)
        base, auth = f"http://gw/sessions/{s.id}", {"Authorization": f"Bearer {s.key}"}
        out = []
        transport = httpx.ASGITransport(app=build_app(registry), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport) as c:
            for path, body in [("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
                               ("/v1/completions", {"prompt": ""}), ("/finish", {"reward": "high"}),
                               ("/v1/chat/completions", {"messages": MSGS})]:
                r = await c.post(base + path, json=body, headers=auth)
                out.append((r.status_code, r.json()["error"]["param"] or r.json()["error"]["code"]))
        return out

    assert asyncio.run(main()) == [(400, "messages[0].role"), (400, "prompt"), (400, "reward"), (409, "session_closed")]


def test_a_text_completion_with_logprobs_0_carries_the_sampled_tokens_logprobs() -> None:
    """OpenAI's legacy completions: `logprobs: n` asks for the n most likely alternatives, and "the API
    will always return the logprob of the sampled token" (vLLM does so too): 0 is the sampled tokens'
    logprobs without alternatives, not none."""
    for lp in (0, 1):
        r, _, _ = asyncio.run(_raw_call("/v1/completions", json.dumps({"prompt": "123+456=", "logprobs": lp}).encode()))
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["logprobs"]
        assert got is not None and got["token_logprobs"] and set(got["token_logprobs"]) == {-0.5}, (lp, got)
    r, _, _ = asyncio.run(_raw_call("/v1/completions", json.dumps({"prompt": "123+456="}).encode()))
    assert r.json()["choices"][0]["logprobs"] is None


def test_the_renderer_cache_is_bounded_in_bytes() -> None:
    """Each distinct tools list is a renderer kept for later calls; the agent chooses them (up to
    agent.max_request_bytes each), so the cache is bounded in their bytes as well as in count."""
    from services.common.tiny import build_tokenizer
    from services.rollout.gateway import GatewayLimits, SessionRegistry
    from services.rollout.gateway.sessions import _RENDERER_BYTES_KEPT

    registry = SessionRegistry(build_tokenizer(tools=True), GatewayLimits(max_model_len=512, response_budget=256))
    for i in range(12):
        tools = [{"type": "function", "function": {"name": f"f{i}", "description": "d" * (3 << 20),
                                                   "parameters": {"type": "object", "properties": {}}}}]
        registry._renderer(tools)
    kept = sum(len(k) for k in registry._renderers)
    assert 0 < kept <= _RENDERER_BYTES_KEPT and len(registry._renderers) < 12
