"""The tool-task agent service (examples/gateway_agent/tool_add_service.py) against the in-process
tool loop it stands in for: the same tool schema as the tool YAML, the same calculator answers and
error texts, and — its real HTTP server called by meshrl's gateway agent, the official `openai` SDK
inside it — the same trajectory token for token (ids, loss mask, turns, final answer) as the
AgentLoop with the ToolEnvironment builds from the same policy turns, budget cuts and turn limit
included. The policy is scripted (a hand-written engine), so both paths see identical turns."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from meshrl.v1 import common_pb2
from services.common.tiny import build_tokenizer
from services.environment.factory import EnvironmentRouter
from services.environment.tool_env import ToolEnvironment
from services.environment.tools import load_tools
from services.rollout.agent.loop import AgentLoop, AgentSettings, truncate_text
from services.rollout.agent.parser import parse_tool_calls
from services.rollout.engines.base import SamplingSpec
from services.rollout.gateway import GatewayAgent, GatewayLimits, GatewaySettings, SessionRegistry
from services.rollout.gateway.app import GatewayServer
from services.rollout.gateway.app import build_app as build_gateway_app
from tests.unit.test_agent_loop import ScriptedEngine
from tests.unit.test_gateway import ScriptedPolicy, score_by_text

ROOT = Path(__file__).resolve().parents[2]
TOOL_YAML = str(ROOT / "configs" / "examples" / "tool_add_tools.yaml")
_spec = importlib.util.spec_from_file_location("tool_add_service", ROOT / "examples" / "gateway_agent" / "tool_add_service.py")
assert _spec is not None and _spec.loader is not None
svc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(svc)

CALL = '<tool_call>{"name":"add","arguments":{"a":123,"b":456}}</tool_call><|im_end|>'
ANSWER = "579<|im_end|>"
WRONG = "578<|im_end|>"


def _prompt() -> common_pb2.Prompt:
    p = common_pb2.Prompt(prompt_seq=3, prompt_id="train:3", data_source="meshrl/tool_add", ground_truth="579")
    p.messages.add(role="user", content="123+456=")
    return p


def test_the_service_offers_the_tool_yaml_schema_byte_for_byte() -> None:
    schemas = [t.tool_schema.model_dump(exclude_none=True) for t in load_tools(TOOL_YAML)]
    assert json.dumps(svc.TOOLS) == json.dumps(schemas)  # key order too: chat templates render it


@pytest.mark.parametrize("args", [
    '{"a": 123, "b": 456}', '{"a": "12", "b": " -7 "}', '{"a": 1.5, "b": 2}', '{"a": true, "b": 2}',
    '{"a": 1}', '{"a": 1, "b": 2, "c": 3}', '{"a": "x", "b": 2}', "[1, 2]",
])
def test_the_calculator_answers_as_the_in_process_tool(args: str) -> None:
    env = ToolEnvironment(load_tools(TOOL_YAML))
    (call,) = parse_tool_calls(f'<tool_call>{{"name": "add", "arguments": {args}}}</tool_call>')[1]

    async def in_process() -> str:
        from services.environment.base import EnvPrompt, Message

        await env.start("s", EnvPrompt(prompt_id="p", messages=(Message("user", "1+2="),)))
        step = await env.step("s", 0, "", [call])
        return step.messages[0].content

    expected = asyncio.run(in_process()) if not call.parse_error else None
    if expected is None:  # not a JSON object: the gateway shows such a call as text, never as a tool call
        assert svc.run_tool("add", args).startswith("Error: invalid arguments for add")
        return
    assert svc.run_tool(call.name, call.arguments_json) == expected
    assert svc.truncate_middle(expected, 16) == truncate_text(expected, 16, "middle")[0]
    assert svc.run_tool("mul", "{}") == "Error: unknown tool 'mul'; available tools: ['add']"


def _in_process(turns: list[str], budget: int) -> tuple[list[int], Any]:
    tok = build_tokenizer(tools=True)
    engine = ScriptedEngine(tok, turns)
    loop = AgentLoop(tok, EnvironmentRouter(ToolEnvironment(load_tools(TOOL_YAML)), []),
                     AgentSettings(max_assistant_turns=3, max_tool_response_length=64))

    async def go() -> tuple[list[int], list[Any]]:
        return await loop.run_group(_prompt(), SamplingSpec(n=1, max_tokens=budget), "r/L1", engine.generate,
                                    lambda: False, lambda: engine.version)

    prompt_ids, (t,) = asyncio.run(go())
    return prompt_ids, t


@contextlib.asynccontextmanager
async def _gateway_to_service(tok: Any, agent: Any, limits: GatewayLimits) -> AsyncIterator[GatewayAgent]:
    """The gateway (real HTTP) with agent.endpoint pointing at the agent service (real HTTP)."""
    service = GatewayServer(svc.build_app(agent), "127.0.0.1", 0)
    service_port = await service.start()
    registry = SessionRegistry(tok, limits)
    ga = GatewayAgent(tok, registry, GatewaySettings(command=None, endpoint=f"http://127.0.0.1:{service_port}/run",
                                                     sample_timeout_s=60, max_concurrent=4), scorer=score_by_text)
    gw = GatewayServer(build_gateway_app(registry), "127.0.0.1", 0)
    port = await gw.start()
    ga.base_url = lambda sid: f"http://127.0.0.1:{port}/sessions/{sid}/v1"
    try:
        yield ga
    finally:
        await ga.aclose()
        await gw.stop()
        await service.stop()
        await agent.http.aclose()


def _through_the_service(turns: list[str], budget: int) -> tuple[common_pb2.TrajectoryGroup, dict[str, int]]:
    tok = build_tokenizer(tools=True)
    agent = svc.ToolAddAgent(max_turns=3, max_parallel_calls=1, max_tool_response_length=64)

    async def go() -> common_pb2.TrajectoryGroup:
        policy = ScriptedPolicy(tok, turns)
        async with _gateway_to_service(tok, agent, GatewayLimits(max_model_len=512, response_budget=budget)) as ga:
            return await ga.play(_prompt(), SamplingSpec(n=1, max_tokens=budget), "r/L1", "L1", "r", policy.generate,
                                 cancelled=lambda: False, version=lambda: 0)

    return asyncio.run(go()), agent.counters


@pytest.mark.parametrize(("turns", "budget", "reward"), [
    ([CALL, ANSWER], 96, 1.0),                  # call, result, answer
    ([ANSWER], 96, 1.0),                        # answers in its head
    ([CALL, CALL, CALL, ANSWER], 200, 0.0),     # the turn limit (3) ends it on a call
    ([CALL.replace("456", '"x"'), WRONG], 200, 0.0),  # the tool's error is the environment's message
    ([CALL, ANSWER], 40, 0.0),                  # the tool result does not fit the budget: ends on the call
    ([CALL, ANSWER], 20, 0.0),                  # the call itself is cut by the budget
])
def test_the_service_builds_the_trajectory_the_in_process_loop_builds(turns: list[str], budget: int, reward: float) -> None:
    prompt_ids, t = _in_process(turns, budget)
    group, counters = _through_the_service(turns, budget)
    (r,) = group.responses
    assert list(group.prompt_token_ids) == prompt_ids
    assert list(r.token_ids) == t.token_ids and list(r.loss_mask) == t.loss_mask
    assert r.num_turns == t.num_turns and r.final_text == t.final_text
    # agent/tool_call_rate (trajectories with a call) agrees; the counts differ by design where the
    # turn limit ends a trajectory on a call: the loop counts calls it ran, the gateway calls it parsed.
    assert (r.tool_calls > 0) == (t.tool_calls > 0)
    assert r.env_reward == reward  # finished without a reward: the scorer scored the last answer
    assert r.env_metrics["gateway_stitch_mismatches"] == 0  # every call extended the one before
    assert counters["samples"] == 1 and counters["failed"] == 0
    if t.tool_calls and budget >= 96 and len(turns) > 1:
        assert 0 in t.loss_mask and 1 in t.loss_mask  # the tool's answer is masked, the policy's turns are not


@pytest.mark.parametrize(("lease_id", "fails"), [("L1", True), ("r/L1", False)])
def test_staleness_bounds_leased_groups_only(lease_id: str, fails: bool) -> None:
    """The policy moves 2 versions between a sample's calls (max_staleness_versions 1): a leased
    group fails (its prompt is re-queued); a Generate call (validation: the worker passes its request
    id as the lease id) holds no lease and is not trained on, so it completes."""
    from services.rollout.gateway import GatewayGroupFailed

    tok = build_tokenizer(tools=True)
    agent = svc.ToolAddAgent()

    class Moving(ScriptedPolicy):
        async def generate(self, req: Any) -> Any:
            out = await super().generate(req)
            self.version += 2
            return out

    async def go() -> bool:
        policy = Moving(tok, [CALL, ANSWER])
        limits = GatewayLimits(max_model_len=512, response_budget=96, max_staleness_versions=1)
        async with _gateway_to_service(tok, agent, limits) as ga:
            try:
                await ga.play(_prompt(), SamplingSpec(n=1, max_tokens=96), "r/L1", lease_id, "r", policy.generate,
                              cancelled=lambda: False, version=lambda: policy.version)
                return False
            except GatewayGroupFailed:
                return True

    assert asyncio.run(go()) is fails
