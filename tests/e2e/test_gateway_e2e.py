"""End to end, the OpenAI-compatible gateway: `meshrl train configs/examples/tool_add.yaml` with
the in-process agent loop off and `agent.command` set to an agent program that only knows the
`openai` SDK (examples/gateway_agent/tool_add_agent.py). Five real services on a local Ray Serve,
real gRPC, the coordinator's SQLite ledger, the tiny Qwen3 warm start, real optimizer steps: every
group the trainer consumes was played by agent programs through the rollout replica's gateway, and
the ledger balances."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "examples" / "tool_add.yaml"


def _balanced_run(run_dir: Path, steps: int) -> list[dict[str, float]]:
    """The run's audit (every one of its 4 x steps prompts trained once) and its per-step metrics."""
    audit = json.loads((run_dir / "summary.json").read_text())["audit"]
    assert audit["balanced"], audit
    assert audit["lost"] == 0 and audit["duplicated"] == 0 and audit["issued"] == 4 * steps
    recs = [json.loads(line) for line in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines() if line]
    assert len(recs) == steps
    return recs


@pytest.mark.slow  # ~85 s on 2 cores, most of it bringing the five services up
def test_an_openai_sdk_agent_program_produces_the_groups_the_trainer_consumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 3
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "MESHRL_LOG_LEVEL": "WARNING",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "meshrl.cli", "train", str(CONFIG), "actor_rollout_ref.rollout.multi_turn.enable=false",
           "agent.command=[python, examples/gateway_agent/tool_add_agent.py]",  # as README writes it
           "agent.max_concurrent=8", "actor_rollout_ref.rollout.n=4",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4", f"rollout.total_rollout_steps={4 * steps}",
           "async_training.concurrent_samples_per_replica=4", "trainer.test_freq=-1", "trainer.save_freq=-1",
           "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, f"meshrl train failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    recs = _balanced_run(run_dir, steps)
    # Every trajectory came through the gateway: its calls are recorded with the group, and the
    # agent's tool results are environment tokens (masked), so trajectories outrun policy tokens
    # whenever the policy called the tool.
    assert all(r["agent/num_turns/mean"] >= 1 for r in recs)
    assert all(r["agent/trajectory_length/mean"] > r["response_length/mean"] for r in recs if r["agent/tool_call_rate"] > 0)
    assert any(r["agent/tool_call_rate"] > 0 for r in recs), "the warm start calls its tool in ~30% of answers"


@pytest.mark.slow  # ~90 s on 2 cores, most of it bringing the five services up
def test_an_agent_service_behind_agent_endpoint_plays_the_tool_task(tmp_path: Path) -> None:
    """configs/examples/tool_add_gateway.yaml as README runs it: the agent *service*
    (examples/gateway_agent/tool_add_service.py, one process, the openai SDK's AsyncOpenAI) started
    on a free port, meshrl POSTing every sample to it (agent.endpoint)."""
    run_dir = tmp_path / "run"
    steps = 3
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "MESHRL_LOG_LEVEL": "WARNING",
           "PYTHONUNBUFFERED": "1"}
    service = subprocess.Popen([sys.executable, "examples/gateway_agent/tool_add_service.py", "--port", "0"], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert service.stdout is not None
        url = service.stdout.readline().strip()  # the service prints its URL once it listens
        assert url.startswith("http://127.0.0.1:") and url.endswith("/run"), (url, service.poll())
        cmd = [sys.executable, "-m", "meshrl.cli", "train", str(ROOT / "configs" / "examples" / "tool_add_gateway.yaml"),
               f"agent.endpoint={url}", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
               f"rollout.total_rollout_steps={4 * steps}", "async_training.concurrent_samples_per_replica=8",
               "agent.max_concurrent=8", "trainer.test_freq=-1", "trainer.save_freq=-1", "--run-dir", str(run_dir)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert out.returncode == 0, f"meshrl train failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
        status = httpx.get(url.removesuffix("/run") + "/status", timeout=10).json()
    finally:
        service.terminate()
        service.wait(timeout=30)
    recs = _balanced_run(run_dir, steps)
    # Every consumed sample was played by the service (its counters), none failed, and its tool
    # results are environment tokens (loss mask 0): trajectories outrun the policy's (masked-in) tokens.
    assert status["failed"] == 0 and status["samples"] >= 4 * 4 * steps, status
    assert status["tool_calls"] > 0, status
    assert all(r["agent/num_turns/mean"] >= 1 for r in recs)
    assert any(r["agent/tool_call_rate"] > 0 for r in recs), "the warm start calls its tool in ~30% of answers"
    assert all(r["agent/trajectory_length/mean"] > r["response_length/mean"] for r in recs if r["agent/tool_call_rate"] > 0)
