"""Per-run tokens for `meshrl train`, and secrets kept out of every config file meshrl writes.

    cfg, env = externalize_secrets(cfg)          # inline tokens -> environment variables
    tokens = issue_run_tokens(cfg, run_dir)      # fresh rollout/trainer (and operator) tokens
    write_resolved_config(cfg, run_dir)          # holds no secret

The services get their tokens through the environment (a local Ray passes them to every worker in
its runtime_env), never through the config that Serve's applications and config.resolved.yaml
carry. The operator token is the one a person needs (meshrl status/pause/stop ...): it is the
operator's own when set (MESHRL_OPERATOR_TOKEN, coordinator.token, MESHRL_TOKEN), else a fresh one
written to RUN_DIR/operator.token, readable by its owner only.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from services.common.auth import OPERATOR, ROLLOUT, TRAINER, Tokens, env_names, resolve_tokens
from services.common.config import MeshConfig
from services.common.security import reset_process_security, use_role
from services.environment.server import TOKEN_ENV as ENVIRONMENT_TOKEN_ENV

OPERATOR_TOKEN_FILE = "operator.token"


def fresh_token() -> str:
    return secrets.token_urlsafe(32)


def endpoint_token_env(index: int) -> str:
    return f"MESHRL_REWARD_ENDPOINT_{index}_TOKEN"


def environment_endpoint_token_env(index: int) -> str:
    return f"MESHRL_ENVIRONMENT_ENDPOINT_{index}_TOKEN"


def externalize_secrets(cfg: MeshConfig) -> tuple[MeshConfig, dict[str, str]]:
    """CFG without inline secrets, and the environment that carries them instead:
    `coordinator.token` becomes the operator token's variable (unless that is set already); an
    inline `token` of `reward.endpoints[i]` / `environment.endpoints[i]` becomes
    MESHRL_REWARD_ENDPOINT_<i>_TOKEN / MESHRL_ENVIRONMENT_ENDPOINT_<i>_TOKEN (or the endpoint's own
    `token_env`), which its `token_env` then names; `environment.token` becomes
    MESHRL_ENVIRONMENT_TOKEN, where `meshrl environment serve` looks when the field is null."""
    data = cfg.model_dump(mode="json")
    env: dict[str, str] = {}
    legacy = data["coordinator"].get("token")
    if legacy:
        env[env_names(cfg)[OPERATOR]] = legacy
        data["coordinator"]["token"] = None
    _externalize_endpoints(data.get("reward", {}).get("endpoints", []), endpoint_token_env, env)
    environment = data.get("environment", {})
    _externalize_endpoints(environment.get("endpoints", []), environment_endpoint_token_env, env)
    if environment.get("token"):
        env[ENVIRONMENT_TOKEN_ENV] = environment["token"]
        environment["token"] = None
    return MeshConfig.model_validate(data), env


def _externalize_endpoints(endpoints: list[dict[str, Any]], default_env: Callable[[int], str], env: dict[str, str]) -> None:
    for i, ep in enumerate(endpoints):
        if ep.get("token"):
            name = ep.get("token_env") or default_env(i)
            env[name] = ep["token"]
            ep["token"], ep["token_env"] = None, name


def issue_run_tokens(
    cfg: MeshConfig, run_dir: Path, env: MutableMapping[str, str] | None = None
) -> Tokens:
    """Fresh rollout and trainer tokens for this run; the operator's own token, else a fresh one
    (written to RUN_DIR/operator.token, mode 0600). All three go into ENV (default os.environ),
    under the names `security.*_token_env`, for this process and the Ray workers it starts."""
    env = os.environ if env is None else env
    names = env_names(cfg)
    operator = env.get(names[OPERATOR]) or resolve_tokens(cfg, env).operator
    if not operator:
        operator = fresh_token()
        path = run_dir / OPERATOR_TOKEN_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(operator + "\n")
        os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    tokens = Tokens(rollout=fresh_token(), trainer=fresh_token(), operator=operator)
    for role in (ROLLOUT, TRAINER, OPERATOR):
        env[names[role]] = tokens.get(role) or ""
    return tokens


def prepare_run_secrets(cfg: MeshConfig, run_dir: Path) -> tuple[MeshConfig, dict[str, str], Callable[[], None]]:
    """For one `meshrl train`: CFG without secrets, the environment carrying them (also set in
    this process, whose Ray workers inherit it), and a function that puts this process's
    environment and default client security back as they were. This process (the driver) calls
    as the operator."""
    cfg, env = externalize_secrets(cfg)
    names = set(env) | set(env_names(cfg).values())
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(env)
    tokens = issue_run_tokens(cfg, run_dir)
    env.update(tokens.as_env(env_names(cfg)))
    use_role(cfg, OPERATOR)

    def restore() -> None:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reset_process_security()

    return cfg, env, restore
