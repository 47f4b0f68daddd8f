"""actor_rollout_ref.model.path as a hub id: resolved through huggingface_hub's cache, with
HF_HUB_OFFLINE honoured; never contacts the network (every case runs offline, in a subprocess so
huggingface_hub reads HF_HOME and HF_HUB_OFFLINE from its environment as it would in a run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.errors import ConfigError
from services.common.hub import resolve_model_path

pytestmark = pytest.mark.unit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(hf_home: Path, repo_id: str) -> Path:
    """The layout huggingface_hub's cache has after `hf download REPO` (refs/main -> snapshot)."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (snap / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return snap


def resolve_in_subprocess(path: str, hf_home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.getcwd()}
    env.pop("HF_HUB_CACHE", None)
    code = ("import sys; from services.common.hub import resolve_model_path\n"
            "try:\n    print(resolve_model_path(sys.argv[1]))\n"
            "except Exception as e:\n    print(type(e).__name__ + ': ' + str(e)); sys.exit(3)\n")
    return subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=120)


def test_a_local_directory_is_used_as_it_is(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_a_hub_id_in_the_cache_resolves_offline_to_its_snapshot(tmp_path: Path) -> None:
    snap = fake_cache(tmp_path / "hf", "acme/tiny-model")
    out = resolve_in_subprocess("acme/tiny-model", tmp_path / "hf")
    assert out.returncode == 0, out.stdout + out.stderr
    resolved = Path(out.stdout.strip().splitlines()[-1])
    assert resolved.resolve() == snap.resolve()
    assert json.loads((resolved / "config.json").read_text())["model_type"] == "qwen3"


def test_a_hub_id_not_in_the_cache_fails_offline_with_the_fix(tmp_path: Path) -> None:
    out = resolve_in_subprocess("acme/not-downloaded", tmp_path / "hf")
    assert out.returncode == 3, out.stdout + out.stderr
    msg = out.stdout
    assert msg.startswith("ConfigError: actor_rollout_ref.model.path: hub id 'acme/not-downloaded' is not in the")
    assert "HF_HUB_OFFLINE is set" in msg and "hf download acme/not-downloaded" in msg


def test_neither_a_directory_nor_a_hub_id() -> None:
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path: '\./no/such/dir' is neither"):
        resolve_model_path("./no/such/dir")
