"""`meshrl serve-config` + Ray's own `serve run`: a tiny job on a Ray head this test starts.

    ray start --head --block (own temp dir, free port)
    serve run --non-blocking   the YAML less the coordinator: trainer and rollout come up and wait
                               (ResumeTrainer / LeasePrompts answer NOT_FOUND) instead of failing
    serve run serve.yaml       the whole YAML: the coordinator joins, the four others are unchanged
      the test watches through Serve's gRPC ingress only: CoordinatorService/GetStatus
      (application=coordinator) until every prompt is consumed, TrainerService/GetTrainerStatus
      (application=trainer) until the last step is checkpointed; then the ledger audit (a handle
      call from a one-off driver) and the run directory.
    teardown: SIGINT to `serve run` (Serve shuts down), SIGTERM to `ray start --block` (it stops
    the processes it started); anything still naming the test's Ray temp dir fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from meshrl.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.common.serve_util import SERVE_ENV_DEFAULTS
from services.coordinator.client import CoordinatorClient
from tests.integration.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEPS, PROMPTS = 8, 64  # 64 prompts, 8 groups per step (mini-batch 8), 4 samples each
DEADLINE_S = 900.0


# Ray's token authentication with a token of this test's own (not ~/.ray/auth_token): the head
# listens on the node's address while the test runs.
_TOKEN = secrets.token_hex(32)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", MESHRL_LOG_LEVEL="INFO",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=_TOKEN)
    # As `meshrl train` does for a local Ray: Serve's proxy gets more than 5 s to start on 2 busy cores.
    for key, value in SERVE_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)
    return env


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes], sig: int, wait_s: float) -> None:
    """Signal the command we started (it stops what it started), then kill its process group."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of its session (the group is ours)


def _pids_naming(text: str) -> list[int]:
    """Processes whose command line mentions `text` (the test's own Ray temp dir)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(int(d.name))
    return out


def _tail(path: Path, n: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


@pytest.fixture
def ray_head(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Ray head of this test only: a temp dir of its own (so no other process's `ray.init()`
    finds it), 8 logical CPUs (placement, not speed), no dashboard."""
    temp_dir = Path(tempfile.mkdtemp(prefix="mrl", dir="/tmp"))  # short: Ray's socket paths have a length limit
    port = free_port()
    log = tmp_path / "ray_head.log"
    proc = _start([str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=8",
                   "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"], log)
    try:
        deadline = time.monotonic() + 120
        while not (temp_dir / "ray_current_cluster").exists():
            assert proc.poll() is None, f"ray start exited:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"ray start did not come up:\n{_tail(log)}"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", temp_dir
    finally:
        _stop(proc, signal.SIGTERM, 60)
        left = _pids_naming(str(temp_dir))
        for pid in left:  # ours by construction: they name this test's temp dir
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left behind: {left}"


async def _waiting_without_coordinator(grpc_port: int, log: Path) -> None:
    """Until the trainer and rollout replicas answer while the coordinator app does not exist."""
    address = f"127.0.0.1:{grpc_port}"
    deadline = time.monotonic() + DEADLINE_S
    async with grpc.aio.insecure_channel(address) as channel:
        trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
        rollout = rollout_pb2_grpc.RolloutServiceStub(channel)
        coord = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        while time.monotonic() < deadline:
            try:
                st = await trainer.GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest(),
                                                    metadata=(("application", "trainer"),), timeout=10)
                await rollout.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(),
                                               metadata=(("application", "rollout"),), timeout=10)
            except grpc.RpcError:
                await asyncio.sleep(2.0)
                continue
            assert st.step == 0
            with pytest.raises(grpc.RpcError) as err:
                await coord.GetStatus(coordinator_pb2.GetStatusRequest(), metadata=(("application", "coordinator"),),
                                      timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
            return
    raise AssertionError(f"trainer and rollout did not come up without the coordinator:\n{_tail(log)}")


async def _watch(grpc_port: int, serve_run: subprocess.Popen[bytes], log: Path) -> tuple[Any, Any]:
    """Poll the coordinator and the trainer through the ingress until the job is done."""
    address = f"127.0.0.1:{grpc_port}"
    deadline = time.monotonic() + DEADLINE_S
    status = trainer = None
    async with CoordinatorClient(address, application="coordinator", timeout_s=10) as coord, \
            grpc.aio.insecure_channel(address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        while time.monotonic() < deadline:
            assert serve_run.poll() is None, f"serve run exited:\n{_tail(log)}"
            try:
                status = await coord.status()
                trainer = await stub.GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest(),
                                                      metadata=(("application", "trainer"),), timeout=10)
            except grpc.RpcError:  # apps still deploying: NOT_FOUND / UNAVAILABLE
                await asyncio.sleep(2.0)
                continue
            if status.totals.consumed >= PROMPTS and trainer.step >= STEPS and trainer.last_checkpoint_step >= STEPS:
                return status, trainer
            await asyncio.sleep(2.0)
    raise AssertionError(f"job not done in {DEADLINE_S}s: coordinator {status}, trainer {trainer}\n{_tail(log)}")


def _audit(ray_address: str) -> dict[str, Any]:
    """CoordinatorDeployment.audit through a handle, from a one-off driver on the test's cluster."""
    code = (
        "import json, ray\nfrom ray import serve\n"
        f"ray.init(address={ray_address!r}, logging_level='ERROR', log_to_driver=False)\n"
        "print('AUDIT' + json.dumps(serve.get_app_handle('coordinator').audit.remote().result(timeout_s=120)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=300)
    lines = [x for x in out.stdout.splitlines() if x.startswith("AUDIT")]
    assert lines, f"audit failed:\n{out.stdout}\n{out.stderr}"
    return json.loads(lines[-1][len("AUDIT"):])  # type: ignore[no-any-return]


def test_serve_run_of_the_generated_config_trains_a_tiny_job(tmp_path: Path, ray_head: tuple[str, Path]) -> None:
    ray_address, _ = ray_head
    grpc_port, http_port, ps_port = free_port(), free_port(), free_port()
    run_dir = tmp_path / "run"
    gen = subprocess.run(
        [sys.executable, "-m", "meshrl.cli", "serve-config", "--run-dir", str(run_dir),
         f"rollout.total_rollout_steps={PROMPTS}", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "actor_rollout_ref.rollout.n=4", f"serve.grpc_port={grpc_port}", f"serve.http_port={http_port}",
         f"param_server.port={ps_port}", "trainer.save_freq=-1", "trainer.test_freq=-1"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert gen.returncode == 0, gen.stderr
    serve_yaml = tmp_path / "serve.yaml"
    serve_yaml.write_text(gen.stdout)
    doc = yaml.safe_load(gen.stdout)
    assert doc["grpc_options"]["port"] == grpc_port and doc["applications"][0]["args"]["run_dir"] == str(run_dir)

    # First everything but the coordinator (a config of its own, aliases expanded).
    partial = tmp_path / "without_coordinator.yaml"
    partial.write_text(yaml.safe_dump({**doc, "applications": doc["applications"][1:]}, sort_keys=False))
    log = tmp_path / "serve_run.log"
    first = subprocess.run([str(BIN / "serve"), "run", "--non-blocking", "--address", ray_address, str(partial)],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    serve_run = None
    try:
        asyncio.run(_waiting_without_coordinator(grpc_port, tmp_path / "ray_head.log"))
        serve_run = _start([str(BIN / "serve"), "run", "--address", ray_address, str(serve_yaml)], log)
        status, trainer = asyncio.run(_watch(grpc_port, serve_run, log))
        assert status.totals.prompts_total == PROMPTS and status.totals.consumed == PROMPTS
        assert status.policy_version >= 1 and trainer.step == STEPS and trainer.world_size == 1
        audit = _audit(ray_address)
        assert audit["balanced"] and audit["issued"] == PROMPTS, audit
    finally:
        if serve_run is not None:
            _stop(serve_run, signal.SIGINT, 120)  # `serve run` shuts Serve down on Ctrl-C

    # the run directory the YAML named: ledger, metrics, checkpoint, per-service logs
    assert (run_dir / "ledger.sqlite").exists()
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    assert any((run_dir / "checkpoints").iterdir())
    logs = {p: [json.loads(x) for x in p.read_text().splitlines()] for p in (run_dir / "logs").glob("*.jsonl")}
    assert {"coordinator", "trainer", "rollout"} <= {p.name.split(".")[0] for p in logs}, list(logs)
    # the same trainer replica waited for the coordinator, then started (no restart in between)
    waited = [events for p, events in logs.items()
              if any(e["event"] == "coordinator_not_up_yet" for e in events)]
    assert len(waited) == 1 and any(e["event"] == "trainer_started" for e in waited[0])
