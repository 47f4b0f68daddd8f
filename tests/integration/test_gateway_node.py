"""A Node agent (the official `openai` npm package, examples/gateway_agent/node/agent.mjs) started
by `agent.command` plays samples through the gateway: tool calls parsed for it, its echoed
assistant messages and tool results stitched onto the exact ids, its own reward reported to
/finish. Needs node and the package (`npm ci` in that directory; done here when missing, which
needs the npm registry: skipped, with the reason, when it cannot be reached or node is absent)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from meshrl.v1 import common_pb2
from tests.unit.test_gateway import ANSWER, CALL, SCORED, play

NODE_DIR = Path(__file__).resolve().parents[2] / "examples" / "gateway_agent" / "node"


@pytest.fixture(scope="module")
def node_agent() -> list[str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node / npm not installed")
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        out = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True,
                             timeout=300)
        if out.returncode != 0:
            pytest.skip(f"npm ci failed (registry unreachable?): {out.stderr[-500:]}")
    return [node, str(NODE_DIR / "agent.mjs")]


@pytest.mark.parametrize("reward_self", [True, False])
def test_a_node_openai_agent_trains_through_the_gateway(node_agent: list[str], reward_self: bool) -> None:
    command = [*node_agent, "--reward-self"] if reward_self else node_agent
    scored = len(SCORED)
    group, ga, policy = asyncio.run(play(None, [CALL, ANSWER], n=2, command=command))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    # both ways give 1.0 below: who gave it is told by whether the reward service was asked
    assert (len(SCORED) > scored) is not reward_self, SCORED[scored:]
    assert ga.registry.counters["stitch_mismatches"] == 0 and ga.registry.counters["stitched_calls"] == 2
    for r in group.responses:
        assert r.env_reward == 1.0  # its own check of 123+456, or the reward service's of "579"
        assert r.tool_calls == 1 and r.num_turns == 2 and r.final_text == "579"
        assert [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if m] == policy.turns[0] + policy.turns[1]
        env = [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if not m]
        assert "<tool_response>\n579\n</tool_response>" in policy.tok.decode(env)
