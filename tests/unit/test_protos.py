"""The wire contract: generated code is current, buf lint is clean, messages round-trip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    fresh = tmp_path / "meshrl" / "v1"
    committed = ROOT / "meshrl" / "v1"
    names = sorted(p.name for p in fresh.iterdir() if p.name != "__pycache__")
    assert names == sorted(p.name for p in committed.iterdir() if p.name != "__pycache__"), "generated file set differs"
    stale = [n for n in names if (fresh / n).read_bytes() != (committed / n).read_bytes()]
    assert not stale, f"generated code is stale: {stale}; run `python scripts/gen_protos.py` and commit"


def test_buf_lint_clean() -> None:
    buf = ROOT / "node_modules" / ".bin" / "buf"
    if not buf.exists():
        buf_path = shutil.which("buf")
        if buf_path is None:
            if os.environ.get("MESHRL_REQUIRE_BUF") == "1":
                pytest.fail("buf is required (MESHRL_REQUIRE_BUF=1) but not installed; run `npm install`")
            pytest.skip("buf not installed (npm install)")
        buf = Path(buf_path)
    result = subprocess.run([str(buf), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_catches_a_violation(tmp_path: Path) -> None:
    """The lint gate is live: a badly named RPC fails it."""
    buf = ROOT / "node_modules" / ".bin" / "buf"
    if not buf.exists():
        pytest.skip("buf not installed (npm install)")
    (tmp_path / "protos" / "meshrl" / "v1").mkdir(parents=True)
    (tmp_path / "buf.yaml").write_text((ROOT / "buf.yaml").read_text())
    (tmp_path / "protos" / "meshrl" / "v1" / "bad.proto").write_text(
        'syntax = "proto3";\npackage meshrl.v1;\nmessage Req {}\nservice Bad { rpc doIt(Req) returns (Req); }\n'
    )
    result = subprocess.run([str(buf), "lint"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode != 0


def test_every_service_is_generated() -> None:
    from meshrl.v1 import (
        coordinator_pb2_grpc,
        environment_pb2_grpc,
        param_server_pb2_grpc,
        reward_pb2_grpc,
        rollout_pb2_grpc,
        trainer_pb2_grpc,
    )

    for mod, name in [
        (coordinator_pb2_grpc, "CoordinatorService"), (rollout_pb2_grpc, "RolloutService"),
        (reward_pb2_grpc, "RewardService"), (param_server_pb2_grpc, "ParamServerService"),
        (trainer_pb2_grpc, "TrainerService"), (environment_pb2_grpc, "EnvironmentService"),
    ]:
        assert hasattr(mod, f"add_{name}Servicer_to_server")


def test_group_carries_per_token_versions() -> None:
    from meshrl.v1 import common_pb2

    g = common_pb2.TrajectoryGroup(lease_id="l", min_policy_version=3, max_policy_version=4)
    g.responses.add(token_ids=[5, 6], logprobs=[-0.5, -1.0], versions=[3, 4])
    again = common_pb2.TrajectoryGroup.FromString(g.SerializeToString())
    assert list(again.responses[0].versions) == [3, 4]
