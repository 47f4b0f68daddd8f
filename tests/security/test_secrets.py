"""Tokens stay out of every file meshrl writes: config.resolved.yaml, serve-config YAML; `meshrl
train` makes fresh ones per run and the operator's is readable by its owner only."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from meshrl.tokens import OPERATOR_TOKEN_FILE, endpoint_token_env, prepare_run_secrets
from services.common.auth import Authorizer, resolve_tokens
from services.common.config import load_config, write_resolved_config
from services.common.security import default_security

SECRET_OVERRIDES = [
    "coordinator.token=LEGACY-SECRET",
    'reward.endpoints=[{"address": "127.0.0.1:1", "name": "judge", "token": "ENDPOINT-SECRET"}]',
]
NAMES = ("MESHRL_ROLLOUT_TOKEN", "MESHRL_TRAINER_TOKEN", "MESHRL_OPERATOR_TOKEN", "MESHRL_TOKEN",
         endpoint_token_env(0))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def test_the_resolved_config_holds_no_secret(tmp_path: Path) -> None:
    cfg = load_config(None, SECRET_OVERRIDES)
    clean, env, restore = prepare_run_secrets(cfg, tmp_path)
    try:
        text = write_resolved_config(clean, tmp_path).read_text()
        issued = [os.environ[n] for n in NAMES[:3]]
        for secret in ["LEGACY-SECRET", "ENDPOINT-SECRET", *issued]:
            assert secret not in text
        # ... and the services still get them, through the environment.
        assert env["MESHRL_OPERATOR_TOKEN"] == "LEGACY-SECRET"  # the operator's own token is kept
        assert env[endpoint_token_env(0)] == "ENDPOINT-SECRET"
        assert clean.reward.endpoints[0].token_env == endpoint_token_env(0)
        tokens = resolve_tokens(clean)
        assert len({tokens.rollout, tokens.trainer, tokens.operator}) == 3  # three roles, three tokens
        assert default_security().token == "LEGACY-SECRET"  # the driver calls as the operator
        assert not (tmp_path / OPERATOR_TOKEN_FILE).exists()  # the operator knows their own token
    finally:
        restore()
    assert all(n not in os.environ for n in NAMES) and default_security().token is None


def test_fresh_tokens_per_run_and_the_operator_file(tmp_path: Path) -> None:
    cfg = load_config(None, [])
    seen = []
    for run in ("a", "b"):
        _, env, restore = prepare_run_secrets(cfg, tmp_path / run)
        try:
            path = tmp_path / run / OPERATOR_TOKEN_FILE
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert path.read_text().strip() == env["MESHRL_OPERATOR_TOKEN"]
            seen.append(tuple(env[n] for n in NAMES[:3]))
            auth = Authorizer.from_config(cfg)
            assert auth.roles_of(env["MESHRL_ROLLOUT_TOKEN"]) == {"rollout"}
        finally:
            restore()
    assert not set(seen[0]) & set(seen[1])  # nothing carried over between runs


def test_serve_config_yaml_holds_no_secret_and_names_the_variables(tmp_path: Path) -> None:
    from meshrl.serve_config import build_serve_config, render_yaml

    cfg = load_config(None, [*SECRET_OVERRIDES, "actor_rollout_ref.model.path=/models/x"])
    doc = build_serve_config(cfg, tmp_path)
    text = render_yaml(doc, cfg, tmp_path, "meshrl serve-config")
    assert "LEGACY-SECRET" not in text and "ENDPOINT-SECRET" not in text
    for name in ("MESHRL_ROLLOUT_TOKEN", "MESHRL_TRAINER_TOKEN", "MESHRL_OPERATOR_TOKEN"):
        assert name in text
