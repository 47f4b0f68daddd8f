"""A `verifiers` environment (prime-rl's environments package, PyPI) played through the
OpenAI-compatible gateway by a scripted policy (the gateway, its HTTP on loopback and the agent
programs are real; the policy's turns are scripted so that each trajectory is known token for
token). examples/verifiers_agent/: a vf.ToolEnv with the calculator tool `add` and a vf.Rubric, its
dataset made in code; verifiers' own rollout machinery (its chat-completions client on the
session's base URL and key) plays each sample, the rubric's reward goes to /finish. verifiers lives
in its own environment, .venv-verifiers (scripts/setup_verifiers.sh: its openai-agents needs
websockets<17, meshrl's venv pins 17.x); without it these tests skip and say so.

1. The agent program as `agent.command`: the trajectory is verifiers' conversation token for token,
   its loss masks mark the policy's tokens, the rewards are the rubric's (1 for the right sum, 0 for
   a wrong one); a spent response budget ends the rollout truncated and scored.
2. server.py as `agent.endpoint`: one service plays every sample.
3. verifiers' `env.evaluate` through one gateway session: per-example results as scripted.

tests/e2e/test_verifiers_gateway.py trains on the same environment with a real model."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from meshrl.v1 import common_pb2
from services.common.tiny import build_tokenizer
from services.rollout.engines.base import SamplingSpec
from services.rollout.gateway import GatewayAgent, GatewayLimits, GatewaySettings, SessionRegistry
from services.rollout.gateway.app import GatewayServer, build_app
from tests.unit.test_gateway import ANSWER, CALL, PROMPT, ScriptedPolicy, finish, play

ROOT = Path(__file__).resolve().parents[2]
AGENT_DIR = ROOT / "examples" / "verifiers_agent"
VENV_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
CONFIG = ROOT / "configs" / "examples" / "tool_add.yaml"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vf_python() -> str:
    if not VENV_PYTHON.exists():
        pytest.skip(f"{VENV_PYTHON.relative_to(ROOT)} is missing: run scripts/setup_verifiers.sh (verifiers needs "
                    "its own environment)")
    out = subprocess.run([str(VENV_PYTHON), "-c", "import verifiers, datasets"], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        pytest.skip(f".venv-verifiers cannot import verifiers (rerun scripts/setup_verifiers.sh): {out.stderr[-300:]}")
    return str(VENV_PYTHON)


def rubric(question: str, completion: list[dict[str, Any]]) -> float:
    """The environment's reward, recomputed here: the last assistant message is exactly a+b."""
    a, b = (int(x) for x in question.rstrip("=").split("+"))
    last = [m for m in completion if m["role"] == "assistant"][-1]
    return 1.0 if (last.get("content") or "").strip() == str(a + b) else 0.0


@pytest.mark.parametrize(("turns", "reward"), [([CALL, ANSWER], 1.0), (["578<|im_end|>"], 0.0)])
def test_verifiers_rollouts_through_the_gateway_are_the_trajectories(
    vf_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, turns: list[str], reward: float,
) -> None:
    log = tmp_path / "agent.jsonl"
    monkeypatch.setenv("VERIFIERS_AGENT_LOG", str(log))
    group, ga, policy = asyncio.run(play(None, turns, n=2, command=[vf_python, str(AGENT_DIR / "agent.py")],
                                         timeout_s=240))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    records = sorted((json.loads(line) for line in log.read_text().splitlines()), key=lambda rec: rec["sample_index"])
    assert [rec["sample_index"] for rec in records] == [r.sample_index for r in group.responses] == [0, 1]
    assert ga.registry.counters["stitch_mismatches"] == 0
    for r, rec in zip(group.responses, records, strict=True):
        assert rec["question"] == "123+456=" and rec["answer"] == "579"
        assert r.env_reward == rec["reward"] == rubric(rec["question"], rec["completion"]) == reward
        policy_ids = [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if m]
        env_ids = [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if not m]
        assert policy_ids == [t for turn in policy.turns[: len(turns)] for t in turn]  # every policy token, trained
        assert policy.tok.decode(list(group.prompt_token_ids)).endswith("<|im_start|>user\n123+456=<|im_end|>\n"
                                                                        "<|im_start|>assistant\n")
        if len(turns) == 2:  # verifiers ran the tool: its result is in the trajectory, masked
            assert r.tool_calls == 1 and r.num_turns == 2 and r.final_text == "579"
            assert "<tool_response>\n579\n</tool_response>" in policy.tok.decode(env_ids)
            assert [m["role"] for m in rec["completion"]] == ["assistant", "tool", "assistant"]
        else:
            assert r.num_turns == 1 and not env_ids and r.final_text == "578"


def test_a_spent_response_budget_ends_the_rollout_truncated_and_scored(
    vf_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway's 400 context_length_exceeded is verifiers' overlong prompt: the rollout ends
    truncated, the rubric scores what the policy answered (here: a tool call, no answer, so 0), the group
    is submitted (a policy that runs out of budget is not an agent failure)."""
    log = tmp_path / "agent.jsonl"
    monkeypatch.setenv("VERIFIERS_AGENT_LOG", str(log))
    group, ga, _ = asyncio.run(play(None, [CALL], n=1, command=[vf_python, str(AGENT_DIR / "agent.py")],
                                    timeout_s=240, budget=BUDGET))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    (rec,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert rec["truncated"] and rec["error"] is None and rec["reward"] == 0.0 == group.responses[0].env_reward
    # the first call's tool call fit; the call after the tool's result was refused (400), which
    # without agent.py's GatewayClient would have crashed the rollout and failed the group
    assert ga.registry.counters["calls"] == 1 and [m["role"] for m in rec["completion"]] == ["assistant"]
    assert rec["completion"][0]["tool_calls"][0]["name"] == "add"


BUDGET = 60  # tokens: the scripted tool call (53) fits, it and the tool's result do not


def test_the_endpoint_service_plays_each_sample(vf_python: str, tmp_path: Path) -> None:
    """server.py as `agent.endpoint`: one process, verifiers imported once, a POST per sample."""
    server = subprocess.Popen([vf_python, str(AGENT_DIR / "server.py"), "--port", "0"], stdout=subprocess.PIPE,
                              stderr=(tmp_path / "server.err").open("w"), text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # printed once it accepts requests; empty if it died
        assert line.startswith("listening on "), (tmp_path / "server.err").read_text()[-2000:]
        endpoint = line.split()[-1]

        async def main() -> tuple[common_pb2.TrajectoryGroup, ScriptedPolicy]:
            tok = build_tokenizer(tools=True)
            policy = ScriptedPolicy(tok, [CALL, ANSWER])
            registry = SessionRegistry(tok, GatewayLimits(max_model_len=512, response_budget=256))
            ga = GatewayAgent(tok, registry, GatewaySettings(command=None, endpoint=endpoint, sample_timeout_s=240,
                                                             max_concurrent=4))
            http = GatewayServer(build_app(registry), "127.0.0.1", 0)
            port = await http.start()
            ga.base_url = lambda sid: f"http://127.0.0.1:{port}/sessions/{sid}/v1"
            try:
                group = await ga.play(PROMPT, SamplingSpec(n=3, max_tokens=256), "rep/lease-1", "lease-1", "rep",
                                      policy.generate, cancelled=lambda: False, version=lambda: policy.version)
            finally:
                await http.stop()
            return group, policy

        group, policy = asyncio.run(main())
        for r in group.responses:
            assert r.env_reward == 1.0 and r.tool_calls == 1 and r.num_turns == 2 and r.final_text == "579"
            assert [t for t, m in zip(r.token_ids, r.loss_mask, strict=True) if m] == policy.turns[0] + policy.turns[1]
    finally:
        server.terminate()
        server.wait(timeout=30)


# The environment's first three examples (addition_env.make_dataset, seed 0) are 846+326=, 674+152=,
# 182+135=; with one rollout in flight the session's calls answer them in order.
EVAL_TURNS = ['<tool_call>{"name": "add", "arguments": {"a": 846, "b": 326}}</tool_call><|im_end|>', "1172<|im_end|>",
              "825<|im_end|>", "317<|im_end|>"]


def test_verifiers_evaluate_through_a_gateway_session(vf_python: str) -> None:
    results: list[dict[str, Any]] = []

    async def evaluate(url: str, key: str, prompt: dict[str, Any]) -> None:
        proc = await asyncio.create_subprocess_exec(
            vf_python, str(AGENT_DIR / "evaluate.py"), "--num-examples", "3",
            env={**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": key},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()[-2000:]
        results.append(json.loads(out))
        (await finish(url, key, {"reward": results[-1]["mean_reward"]})).raise_for_status()

    group, ga, _ = asyncio.run(play(evaluate, EVAL_TURNS, n=1, timeout_s=240))
    assert isinstance(group, common_pb2.TrajectoryGroup), group
    (res,) = results
    got = [(e["question"], e["answer"], e["last_answer"], e["turns"], e["reward"]) for e in res["examples"]]
    assert got == [("846+326=", "1172", "1172", 2, 1.0), ("674+152=", "826", "825", 1, 0.0),
                   ("182+135=", "317", "317", 1, 1.0)]
    assert res["mean_reward"] == pytest.approx(2 / 3) and group.responses[0].env_reward == pytest.approx(2 / 3)
    # all four calls went through the session; each new example is a new conversation (a new segment)
    assert ga.registry.counters["calls"] == 4 and ga.registry.counters["stitch_mismatches"] == 2


