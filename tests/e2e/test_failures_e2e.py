"""`meshrl train` against a part that keeps failing: an external reward endpoint whose results
lack `item_id` (a real RewardService on loopback that answers garbage). The first real cause
reaches the terminal in one line, the run stops (no crash loop of rollout replicas), and
summary.json says why and how to resume.

    validation first (trainer.val_before_train)  the validation call's own error stops the run
    no validation                                 groups fail and come back with their error; the
                                                  coordinator halts leasing after
                                                  coordinator.max_consecutive_failures and the
                                                  driver stops with its reason
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from meshrl.v1 import reward_pb2 as pb
from tests.e2e.test_train_e2e import _env

pytestmark = pytest.mark.slow


@pytest.fixture
def garbage_endpoint() -> Iterator[str]:
    """A RewardService whose results carry no item_id, on its own loop in a thread."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, object] = {}

    async def score(request: bytes, context: object) -> bytes:
        req = pb.ScoreRequest.FromString(request)
        return pb.ScoreResponse(results=[pb.ScoreResult(score=1.0) for _ in req.items]).SerializeToString()

    async def start() -> None:
        server = grpc.aio.server()
        method = grpc.unary_unary_rpc_method_handler(score, request_deserializer=None, response_serializer=None)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("meshrl.v1.RewardService", {"Score": method})])
        state["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        state["server"] = server
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(30)
    yield f"127.0.0.1:{state['port']}"
    server = state["server"]
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)  # type: ignore[attr-defined]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


@pytest.mark.parametrize("validate_first", [True, False])
def test_a_reward_endpoint_that_answers_garbage_stops_the_run_with_its_cause(
    tmp_path: Path, garbage_endpoint: str, validate_first: bool
) -> None:
    run_dir = tmp_path / "run"
    endpoint = f"{{address: '{garbage_endpoint}', name: judge, data_sources: [meshrl/addition], max_retries: 0}}"
    overrides = ["rollout.total_rollout_steps=640", f"reward.endpoints=[{endpoint}]",
                 "trainer.test_freq=5" if validate_first else "trainer.test_freq=-1",
                 f"trainer.val_before_train={str(validate_first).lower()}"]
    cmd = [sys.executable, "-m", "meshrl.cli", "train", *overrides, "--run-dir", str(run_dir), "--no-report"]
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    (tmp_path / "train.out").write_text(text)
    assert out.returncode == 1, text[-4000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, text[-4000:]
    # The cause, named by the reward service, on one line: never an AttributeError from the error path.
    assert "judge" in errors[0] and "item_id is ''" in errors[0], errors
    for bad in ("AttributeError", "Traceback"):
        assert bad not in text, text[max(0, text.index(bad) - 2000):text.index(bad) + 2000]
    assert f"resume: meshrl train --resume {run_dir}" in out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "item_id is ''" in summary["failure"] and summary["resume"] == f"meshrl train --resume {run_dir}"
    assert summary["audit"]["balanced"], summary["audit"]
    if not validate_first:
        # The rollouts reported what failed their groups, and leasing halted on it: a few
        # replica restarts at most, not a crash loop.
        assert summary["failure"].startswith("leasing halted: ") and "in a row" in summary["failure"]
        kinds = [i["kind"] for i in summary["incidents"]]
        assert "rollout_failure" in kinds
        rollout_logs = list((run_dir / "logs").glob("rollout.*.jsonl"))
        assert len(rollout_logs) <= 3, [p.name for p in rollout_logs]
