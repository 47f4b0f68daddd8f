"""`meshrl train` (meshrl/train.py): a fresh run refuses an earlier run's directory and default
directories never collide; Ctrl-C's Stop is sent again until the coordinator takes it; an error
in the watch loop is a clean stop (the trainer checkpoints), not a teardown; --resume refuses to
start without the endpoint token the first run had. No Ray: everything train() and MeshRun.watch
call on Ray, Serve or the coordinator is faked here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

import meshrl.train as train_mod
from meshrl.train import MeshRun, Progress, new_run_dir, resolve_config, train
from meshrl.watchdog import RunFailed
from services.common.errors import ConfigError

# ---- fakes ------------------------------------------------------------------------------------


def _fake_mesh(monkeypatch: pytest.MonkeyPatch, seen: list[dict[str, Any]]) -> None:
    """train() without Ray, the warm start or trackers: deploy records what the services would
    get; the watch ends at once."""
    import meshrl.tensorboard
    import meshrl.trackers
    import services.common.logging

    monkeypatch.setattr(train_mod, "ensure_model", lambda cfg: cfg)
    monkeypatch.setattr(meshrl.trackers, "start_tracking", lambda *a, **k: None)
    monkeypatch.setattr(services.common.logging, "configure_logging", lambda *a, **k: None)
    monkeypatch.setattr(meshrl.tensorboard, "write_tensorboard", lambda run_dir: None)
    monkeypatch.setenv("MESHRL_LOG_DIR", os.environ.get("MESHRL_LOG_DIR", ""))

    def deploy(self: MeshRun) -> None:
        seen.append({"run_dir": self.run_dir, "secret_env": dict(self.secret_env), "environ": dict(os.environ),
                     "cfg": self.cfg})
        self.deployed = True

    monkeypatch.setattr(MeshRun, "deploy", deploy)
    monkeypatch.setattr(MeshRun, "stop_rollouts", lambda self: None)
    monkeypatch.setattr(MeshRun, "shutdown", lambda self: None)
    monkeypatch.setattr(MeshRun, "summarize", lambda self, p: {"run_dir": str(self.run_dir), "audit": {"balanced": True}})
    monkeypatch.setattr(train_mod, "_watch", lambda run, on_progress: Progress(trainer_state="finished"))


class _Client:
    """CoordinatorClient as MeshRun.watch uses it. The first `down_stops` Stop calls fail as they
    do while Serve restarts the coordinator (UNAVAILABLE)."""

    def __init__(self, down_stops: int = 0) -> None:
        self.down_stops = down_stops
        self.stop_calls = 0
        self.stops_delivered = 0

    async def __aenter__(self) -> _Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def stop(self) -> None:
        self.stop_calls += 1
        if self.stop_calls <= self.down_stops:
            raise RuntimeError("UNAVAILABLE: the coordinator is being restarted")
        self.stops_delivered += 1

    async def status(self) -> None:
        return None


def _watched_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, client: _Client, *,
                 polls_after_stop: int = 3, max_polls: int = 40) -> tuple[MeshRun, dict[str, int]]:
    """A MeshRun whose trainer trains until a Stop reaches the coordinator, then finishes (its
    checkpoint) a few polls later; without a Stop it finishes after max_polls (the end of the run)."""
    import services.coordinator.client

    cfg = resolve_config(None, ["trainer.val_before_train=false", "trainer.test_freq=-1"])
    run = MeshRun(cfg, tmp_path, "fully_async")
    monkeypatch.setattr(services.coordinator.client, "CoordinatorClient", lambda *a, **k: client)
    real_sleep = asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda *_a, **_k: real_sleep(0))
    count = {"polls": 0, "delivered_at": -1, "polls_after_stop": 0}

    async def poll(_client: Any) -> Progress:
        count["polls"] += 1
        if client.stops_delivered and count["delivered_at"] < 0:
            count["delivered_at"] = count["polls"]
        if count["delivered_at"] >= 0:
            count["polls_after_stop"] = count["polls"] - count["delivered_at"]
            if count["polls_after_stop"] >= polls_after_stop:
                return Progress(step=5, trainer_state="finished")
        if count["polls"] >= max_polls:
            return Progress(step=500, trainer_state="finished")
        return Progress(step=5, trainer_state="training")

    monkeypatch.setattr(run, "poll", poll)
    return run, count


# ---- run directories ---------------------------------------------------------------------------


def test_fresh_run_into_an_existing_run_dir_does_not_take_it_over(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`meshrl train ... --run-dir DIR` (no --resume) on DIR of an earlier run: the new run
    overwrites the earlier config.resolved.yaml and starts its services on the earlier run's
    ledger.sqlite and checkpoints (the trainer's resume_mode=auto picks up its newest
    checkpoint), i.e. a silent resume under a different config. It must refuse before it writes
    or starts anything."""
    seen: list[dict[str, Any]] = []
    _fake_mesh(monkeypatch, seen)
    earlier = tmp_path / "exp1"
    (earlier / "checkpoints" / "global_step_100").mkdir(parents=True)
    (earlier / "ledger.sqlite").write_bytes(b"SQLite format 3\x00 earlier run")
    original = "# the earlier run's resolved config\ntrainer: {experiment_name: earlier}\n"
    (earlier / "config.resolved.yaml").write_text(original)

    with contextlib.suppress(Exception):
        train(None, ["algorithm.adv_estimator=rloo"], run_dir=earlier, report=False)

    assert not seen, "a fresh run was deployed into an earlier run's directory (its ledger and checkpoints)"
    assert (earlier / "config.resolved.yaml").read_text() == original, "the earlier run's config was overwritten"


def test_default_run_dirs_of_runs_started_in_the_same_second_differ(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The default run directory is runs/<experiment>-<mode>-<YYYYmmdd-HHMMSS>: two `meshrl train`
    started within the same second (a sweep launched from a script) get the same directory and
    share one ledger, one set of checkpoints and one config.resolved.yaml."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_mod.time, "strftime", lambda fmt, *a: "20261127-162001")
    cfg = resolve_config(None, [])
    first = new_run_dir(cfg, "fully_async")
    first.mkdir(parents=True)
    (first / "config.resolved.yaml").write_text("first run\n")
    second = new_run_dir(cfg, "fully_async")
    assert second != first, f"both runs use {first}"


# ---- Ctrl-C / failure: the clean stop ----------------------------------------------------------


def test_ctrl_c_stop_is_retried_when_the_coordinator_does_not_take_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ctrl-C while Serve restarts the coordinator (the case the watchdog waits out): the one
    Stop call fails, _send_stop logs it and still sets _stop_sent_at, and the loop never sends
    it again. The trainer trains on to the end of the run (hours) while the driver reports
    'stop_in_progress' every 30 s; the user's only way out is the second Ctrl-C, which aborts
    without a checkpoint."""
    client = _Client(down_stops=1)
    run, count = _watched_run(monkeypatch, tmp_path, client)
    run.request_stop()  # the first Ctrl-C (_watch's SIGINT handler)
    progress = asyncio.run(run.watch(lambda p: None))
    assert client.stops_delivered >= 1, (
        f"Stop was tried {client.stop_calls}x and never reached the coordinator; the run went on to "
        f"step {progress.step} ({count['polls']} polls)")


def test_unexpected_error_in_the_watch_loop_still_stops_the_trainer_cleanly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An error the watch loop does not expect (a tracker's log() in on_progress, e.g. an MLflow
    or W&B server that went away; a validation error other than a dead replica) propagates out of
    watch() with no Stop sent: train() then shuts Ray down under a healthy trainer, and every step
    since its last checkpoint (save_freq=100 in the example) is lost, although a failure is meant
    to be a clean stop where the trainer still runs (meshrl/watchdog.py)."""
    client = _Client()
    run, count = _watched_run(monkeypatch, tmp_path, client)
    calls = {"n": 0}

    def on_progress(p: Progress) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise ConnectionError("mlflow tracking server: connection refused")

    with contextlib.suppress(Exception):
        asyncio.run(run.watch(on_progress))
    assert client.stops_delivered >= 1, "the mesh is torn down without a Stop: the trainer never checkpoints"
    assert count["polls_after_stop"] >= 1, "the driver did not wait for the trainer to finish its checkpoint"


# ---- resume ------------------------------------------------------------------------------------


def _first_run_with_endpoint_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, var: str, section: str
) -> tuple[Path, list[dict[str, Any]]]:
    """A first run (fake mesh) of the example with `section.endpoints[0]` holding the inline token
    s3cret, `var` unset here: (its run dir, what the fake mesh saw)."""
    monkeypatch.delenv(var, raising=False)
    seen: list[dict[str, Any]] = []
    _fake_mesh(monkeypatch, seen)
    config = tmp_path / f"with_{section}_endpoint.yaml"
    config.write_text(train_mod.EXAMPLE_CONFIG.read_text()
                      + f"{section}:\n  endpoints:\n    - {{address: '127.0.0.1:50061', token: s3cret}}\n")
    run_dir = tmp_path / "run"
    train(str(config), [], run_dir=run_dir, report=False)
    return run_dir, seen


def test_resume_keeps_an_inline_reward_endpoint_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A config with a reward endpoint's inline `token`: the first run moves it to
    MESHRL_REWARD_ENDPOINT_0_TOKEN (set only in that process) and writes token: null,
    token_env: MESHRL_REWARD_ENDPOINT_0_TOKEN into config.resolved.yaml. `--resume` loads that
    file: the variable is unset, so the resumed run's reward service calls the endpoint without a
    token (only an `endpoint_token_missing` warning in the reward's own log), every group fails
    UNAUTHENTICATED and the coordinator halts. The resume must either carry the token or refuse
    to start, naming the variable to export."""
    var = "MESHRL_REWARD_ENDPOINT_0_TOKEN"
    run_dir, seen = _first_run_with_endpoint_token(monkeypatch, tmp_path, var, "reward")
    assert seen[0]["environ"].get(var) == "s3cret"  # the first run had it
    assert var not in os.environ

    seen.clear()
    try:
        train(None, [], resume=run_dir, report=False)
    except Exception as exc:  # refusing to start, naming the variable, is the fix
        assert var in str(exc), exc
        assert not seen
        return
    got = seen[0]["environ"].get(var) or seen[0]["secret_env"].get(var)
    ep = seen[0]["cfg"].reward.endpoints[0]
    assert ep.token == "s3cret" or got == "s3cret", (
        f"the resumed run's reward endpoint has no token (token={ep.token!r}, ${ep.token_env} unset)")


def test_resume_refuses_without_an_environment_endpoints_moved_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The first run moves an environment endpoint's inline token to
    MESHRL_ENVIRONMENT_ENDPOINT_0_TOKEN, as a reward endpoint's: a `--resume` without it would call
    the endpoint with no token (every Start UNAUTHENTICATED, the prompts re-queued, the run
    stalled); it refuses to start instead, naming the variable."""
    var = "MESHRL_ENVIRONMENT_ENDPOINT_0_TOKEN"
    run_dir, seen = _first_run_with_endpoint_token(monkeypatch, tmp_path, var, "environment")
    assert seen[0]["environ"].get(var) == "s3cret"
    assert "s3cret" not in (run_dir / "config.resolved.yaml").read_text()
    seen.clear()
    with pytest.raises(ConfigError, match=f"environment.endpoints: export {var}"):
        train(None, [], resume=run_dir, report=False)
    assert not seen
    monkeypatch.setenv(var, "s3cret")
    train(None, [], resume=run_dir, report=False)
    assert seen and seen[0]["cfg"].environment.endpoints[0].token_env == var


def _train_whose_ray_does_not_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                    overrides: list[str]) -> tuple[list[dict[str, Any]], BaseException | None]:
    import ray

    import meshrl.tensorboard
    import meshrl.trackers
    import services.common.logging
    import services.common.serve_util

    monkeypatch.setattr(train_mod, "ensure_model", lambda cfg: cfg)
    monkeypatch.setattr(meshrl.trackers, "start_tracking", lambda *a, **k: None)
    monkeypatch.setattr(services.common.logging, "configure_logging", lambda *a, **k: None)
    monkeypatch.setattr(meshrl.tensorboard, "write_tensorboard", lambda run_dir: None)
    monkeypatch.setattr(train_mod, "_app_builders", lambda: [])

    def init_ray(*a: Any, **k: Any) -> None:
        raise ConnectionError("could not start or reach Ray")

    monkeypatch.setattr(services.common.serve_util, "init_ray", init_ray)
    inits: list[dict[str, Any]] = []

    def recording_init(*a: Any, **k: Any) -> None:
        inits.append(dict(k))
        raise RuntimeError("ray.init called by the teardown")

    monkeypatch.setattr(ray, "init", recording_init)
    saved = dict(os.environ)
    err: BaseException | None = None
    try:
        train_mod.train(None, ["trainer.val_before_train=false", *overrides], run_dir=tmp_path / "run", report=False)
    except BaseException as exc:
        err = exc
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return inits, err


def test_teardown_after_a_failed_ray_start_does_not_start_or_join_a_ray(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """deploy() fails in init_ray (Ray did not start; or Ctrl-C during its start). train()'s
    finally calls MeshRun.shutdown -> stop_rollouts -> serve.delete("rollout"), and Serve's
    _connect() calls ray.init(namespace="serve") when Ray is not initialized: with no address that
    joins whatever Ray this host runs (RAY_ADDRESS / `ray start`) and deletes ITS "rollout"
    application, or else starts a fresh local Ray just to tear it down again."""
    inits, err = _train_whose_ray_does_not_start(monkeypatch, tmp_path, [])
    assert isinstance(err, RunFailed), repr(err)
    assert not inits, f"the teardown called ray.init{inits} (via serve.delete) after Ray never started"


def test_teardown_of_a_joined_cluster_run_whose_ray_did_not_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As above with serve.ray_address: shutdown() calls serve.shutdown(), which discovers the
    controller through _connect() -> ray.init(namespace="serve") and then shuts down ALL of Serve on
    the Ray it found. Here ray.init raises, and that error escapes train()'s finally: the RunFailed
    (exit 1, cause, resume line) is replaced by a traceback and restore_env is skipped."""
    inits, err = _train_whose_ray_does_not_start(monkeypatch, tmp_path, ["serve.ray_address=ray://10.9.9.9:10001"])
    assert isinstance(err, RunFailed), f"train() raised {err!r} instead of RunFailed (ray.init calls: {inits})"
    assert not inits, f"the teardown called ray.init{inits} (via serve.delete / serve.shutdown)"
