"""`meshrl train` across sessions and signals: a resumed run's ETA counts only the steps this
session trained, its start-up timeline only this session's processes; SIGTERM is a clean stop;
--resume with another --run-dir is refused. No Ray."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import meshrl.train as train_mod
from meshrl.train import MeshRun, resolve_config
from services.common.config import load_config
from services.common.startup import timeline


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class _StatusClient:
    def __init__(self, prompts_total: int = 0) -> None:
        self.prompts_total = prompts_total  # 0: as a status that does not know it (proto default)

    async def status(self) -> Any:
        return SimpleNamespace(policy_version=0, totals=SimpleNamespace(queued=0, in_flight=0,
                                                                        prompts_total=self.prompts_total),
                               failures=[], halted_reason="")


def _trainer_handle(step: dict[str, Any]) -> Any:
    async def status() -> Any:
        return SimpleNamespace(state=step.get("state", "training"), step=step["n"], error="", replica="r1",
                               metrics={})

    return SimpleNamespace(status=SimpleNamespace(remote=status))


def test_eta_of_a_resumed_run_counts_only_the_steps_trained_in_this_session(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`meshrl train --resume` of a run stopped at step 250 of 500: the trainer reports the global
    step (250, from its checkpoint), while elapsed_s counts from this session's start. The ETA
    (elapsed / step * steps left) then takes 250 steps as trained in this session's first minute:
    after 10 more steps of 1 s each (1 s per step, 240 left: ~240 s) it shows ~65 s."""
    from ray import serve

    clock = _Clock(1000.0)
    monkeypatch.setattr(train_mod.time, "time", clock)
    cfg = resolve_config(None, [])
    run = MeshRun(cfg, tmp_path, "fully_async")
    total = run.derived.total_local_steps
    assert total == 500
    # the first poll comes while the trainer still loads its checkpoint: "starting" at step 0
    step: dict[str, Any] = {"n": 0, "state": "starting"}
    monkeypatch.setattr(serve, "get_app_handle", lambda name: _trainer_handle(step))

    async def nothing(*_a: Any, **_k: Any) -> None:
        return None

    monkeypatch.setattr(run, "_check_serve", nothing)
    monkeypatch.setattr(run, "_sample_rollout", nothing)
    client = _StatusClient()

    clock.now = 1055.0
    asyncio.run(run.poll(client))
    clock.now = 1060.0  # start-up (Ray, Serve, deploy) took a minute; the trainer resumed at 250
    step.update(n=250, state="training")
    p = asyncio.run(run.poll(client))
    for _ in range(10):  # ten steps, one a second
        clock.now += 1.0
        step["n"] += 1
        p = asyncio.run(run.poll(client))
    assert p.step == 260
    true_eta = (total - p.step) * 1.0
    assert p.eta_s is not None
    assert abs(p.eta_s - true_eta) <= 0.2 * true_eta, f"ETA {p.eta_s:.0f} s, about {true_eta:.0f} s to go"


def test_progress_total_is_the_run_the_data_caps_at_total_epochs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The run ends at len(data) * rollout.total_epochs prompts when that is fewer than
    rollout.total_rollout_steps (the coordinator's prompts_total, the trainer's total_steps), but
    the driver's progress total and ETA came from the config alone: 8 rows x 2 epochs = 16 prompts
    = 8 trainer steps, shown as x/48 with an ETA six times too long, and the run ended at "17%"."""
    from ray import serve

    from services.common.config import derive

    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(8)))
    cfg = resolve_config(None, [f"data.train_files=[{f}]", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                "async_training.trigger_parameter_sync_step=4", "rollout.total_epochs=2",
                                "rollout.total_rollout_steps=100"])
    capped = derive(cfg, dataset_size=8)
    assert capped.total_rollout_steps == 16 and capped.total_local_steps == 8 < derive(cfg).total_local_steps == 48
    run = MeshRun(cfg, tmp_path, "fully_async")
    monkeypatch.setattr(serve, "get_app_handle", lambda name: _trainer_handle({"n": 3}))

    async def nothing(*_a: Any, **_k: Any) -> None:
        return None

    monkeypatch.setattr(run, "_check_serve", nothing)
    monkeypatch.setattr(run, "_sample_rollout", nothing)
    p = asyncio.run(run.poll(_StatusClient(prompts_total=capped.total_rollout_steps)))
    assert p.total_steps == capped.total_local_steps, f"progress shows {p.step}/{p.total_steps}"


def test_startup_timeline_of_a_resumed_run_holds_only_its_own_processes(tmp_path: Path) -> None:
    """Each session of a run writes logs/startup/<service>.<pid>.json; a --resume writes into the
    same logs/ and MeshRun.deploy puts every file there on the new session's timeline: the first
    session's processes show up in the resumed run's summary.json (startup_s.timeline) with
    start-up phases hours before `meshrl train` started."""
    d = tmp_path / "startup"
    d.mkdir()
    first_session = 1_000.0
    resumed = first_session + 3 * 3600
    (d / "trainer.11.json").write_text(json.dumps(
        {"service": "trainer", "pid": 11, "marks": {"constructor": first_session + 5, "ready": first_session + 30}}))
    (d / "trainer.22.json").write_text(json.dumps(
        {"service": "trainer", "pid": 22, "marks": {"process_started": resumed - 0.5, "constructor": resumed + 4,
                                                    "ready": resumed + 20}}))
    line = timeline(tmp_path, resumed)
    assert list(line) == ["trainer.22"], f"the timeline of the resumed session holds {list(line)}"
    assert all(v >= -1.0 for marks in line.values() for v in marks.values())


def test_sigterm_during_the_watch_is_a_clean_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM (a scheduler's preemption, `timeout`, `docker stop`, systemd) during the watch: Ray's
    driver handler (ray.init sets it) raises SystemExit(15) wherever the main thread is, the mesh is
    torn down with no Stop sent: every step since the last checkpoint is lost and no summary.json is
    written. It must ask for the same clean stop as the first Ctrl-C."""
    import os
    import signal
    import sys
    import threading

    from tests.unit.test_train_sigint import _Run

    def ray_handler(signum: int, frame: object) -> None:  # what ray.init installs
        sys.exit(signum)

    previous = signal.signal(signal.SIGTERM, ray_handler)
    try:
        run = _Run(finish_after_stop_s=0.3)

        def send() -> None:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=send, daemon=True).start()
        progress = train_mod._watch(run, lambda p: None)  # type: ignore[arg-type]
        assert progress.trainer_state == "finished"
        assert run.stop_requested_at is not None
    except SystemExit as exc:
        pytest.fail(f"SIGTERM aborted the watch without a clean stop (SystemExit({exc.code}))")
    finally:
        restored = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)
    assert restored is ray_handler, "the watch left SIGTERM without the driver's handler"


def test_resume_with_another_run_dir_is_not_silently_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`meshrl train --resume runs/a --run-dir runs/b`: train() takes `resume or run_dir`, so --run-dir
    is dropped without a word and runs/a is continued (its config.resolved.yaml rewritten, its ledger
    and checkpoints advanced) where the user asked for runs/b. It must refuse, naming both."""
    from services.common.errors import ConfigError
    from tests.unit.test_train_cli_stops import _fake_mesh

    seen: list[dict[str, Any]] = []
    _fake_mesh(monkeypatch, seen)
    first = tmp_path / "a"
    train_mod.train(None, [], run_dir=first, report=False)
    assert seen
    seen.clear()
    with pytest.raises(ConfigError, match="--run-dir"):
        train_mod.train(None, [], run_dir=tmp_path / "b", resume=first, report=False)
    assert not seen, f"deployed into {seen[0]['run_dir']} for --run-dir {tmp_path / 'b'}"
    # the same directory twice (as the chaos and e2e tests pass it) is a plain resume
    train_mod.train(None, [], run_dir=first, resume=first, report=False)
    assert seen and seen[0]["run_dir"] == first.resolve()


def test_resume_of_a_dump_written_before_trainer_total_epochs_was_read(tmp_path: Path) -> None:
    # Earlier releases dumped `trainer.total_epochs: 1`, a field nothing read, beside the
    # `rollout.total_epochs` the run used: --resume must not refuse them as disagreeing.
    import yaml

    from services.common.config import dump_config, load_config

    tree = yaml.safe_load(dump_config(load_config(None, ["rollout.total_epochs=4"])))
    assert tree["trainer"]["total_epochs"] is None  # a dump now writes null unless it was set
    tree["trainer"]["total_epochs"] = 1
    (tmp_path / "config.resolved.yaml").write_text(yaml.safe_dump(tree))
    cfg = resolve_config(None, [], resume=tmp_path)
    assert cfg.rollout.total_epochs == 4
    # an override on resume still goes through the rule
    assert resolve_config(None, ["rollout.total_epochs=6"], resume=tmp_path).rollout.total_epochs == 6


@pytest.mark.parametrize(("overrides", "needle"), [
    # Each Serve rollout replica is one receiver of the broadcast group: 2 receivers for 1
    # replica made the sender wait for a rank that never checks in, on every version.
    (["actor_rollout_ref.rollout.checkpoint_engine.backend=gloo", "param_server.collective_receivers=2"],
     r"param_server\.collective_receivers=2 .*serve\.rollout\.num_replicas=1"),
    # each replica's devices start one vLLM engine of TP x DP devices
    (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
      "serve.rollout.num_gpus=4"], r"serve\.rollout\.num_gpus=4 .*= 2 devices.*set serve\.rollout\.num_gpus=2"),
    # the trainer's replica only drives its ranks, which hold devices of their own
    (["serve.trainer.num_gpus=1"], r"serve\.trainer\.num_gpus=1 .*set serve\.trainer\.num_gpus=0"),
    # the replicas' devices are the rollout devices verl's keys ask for: 1 x 1 of 4 ran one engine
    (["rollout.n_gpus_per_node=4", "serve.rollout.num_gpus=1"],
     r"rollout\.n_gpus_per_node = 4 .*set serve\.rollout\.num_replicas=4"),
], ids=["collective_receivers", "rollout_gpus", "trainer_gpus", "rollout_pool"])
def test_a_serve_deployment_that_cannot_work_stops_train_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, overrides: list[str], needle: str
) -> None:
    from services.common.errors import ConfigError
    from tests.unit.test_train_cli_stops import _fake_mesh

    seen: list[dict[str, Any]] = []
    _fake_mesh(monkeypatch, seen)
    with pytest.raises(ConfigError, match=needle):
        train_mod.train(None, overrides, run_dir=tmp_path / "run", report=False)
    assert not seen and not (tmp_path / "run").exists()


@pytest.mark.parametrize("resume", [True, False])
def test_meshrl_train_resume_tells_the_coordinator_it_continues_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resume: bool
) -> None:
    """--resume reaches the coordinator replica, which then refuses a ledger that is not there
    (Ledger's create) instead of starting the run over from prompt 0; a new run creates one."""
    from ray import serve

    from services.common import serve_util
    from services.trainer import ranks

    deployed: dict[str, Any] = {}

    class Deployed(Exception):
        """Raised by the stand-in serve.run_many once it has the applications: stops the run there."""

    def run_many(targets: list[Any]) -> None:
        deployed.update({t.name: t.target for t in targets})
        raise Deployed

    monkeypatch.setattr(serve_util, "init_ray", lambda *a, **k: None)
    monkeypatch.setattr(serve_util, "start_serve", lambda *a, **k: (lambda: None))
    monkeypatch.setattr(ranks, "spawn_for", lambda cfg, **k: None)
    monkeypatch.setattr(serve, "run_many", run_many)
    cfg = resolve_config(None, ["serve.ray_address=auto", "serve.parallel_deploy=true"])
    with pytest.raises(Deployed):
        MeshRun(cfg, tmp_path, "fully_async", resume=resume).deploy()
    assert deployed["coordinator"]._bound_deployment.init_args[4] is resume


def test_a_relative_ledger_path_names_the_same_file_when_the_run_is_resumed_from_elsewhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """coordinator.ledger_path=ledgers/a.sqlite: the coordinator replica resolved it against its
    own working directory (a joined cluster's: where `ray start` ran), and config.resolved.yaml
    kept it relative, so `meshrl train --resume` from another directory named another file: a
    fresh ledger, the run over from prompt 0 (now refused: Ledger's create). The driver makes it
    absolute, as `meshrl serve-config` does."""
    from tests.unit.test_train_cli_stops import _fake_mesh

    seen: list[dict[str, Any]] = []
    _fake_mesh(monkeypatch, seen)
    (tmp_path / "home").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "home")
    run_dir = tmp_path / "run"
    train_mod.train(None, ["coordinator.ledger_path=ledgers/a.sqlite"], run_dir=run_dir, report=False)
    ledger = str(tmp_path / "home" / "ledgers" / "a.sqlite")
    assert seen[0]["cfg"].coordinator.ledger_path == ledger
    monkeypatch.chdir(tmp_path / "elsewhere")
    train_mod.train(None, [], resume=run_dir, report=False)
    assert seen[1]["cfg"].coordinator.ledger_path == ledger


def test_a_home_relative_ledger_path_is_the_drivers_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """coordinator.ledger_path=~/ledgers/a.sqlite (a YAML value, or an override the shell did not
    expand): nothing on the replica expands `~` (factory.ledger_path, SQLite), so it opened
    ./~/ledgers/a.sqlite in its own working directory. `meshrl train` expands it on the driver."""
    from tests.unit.test_train_cli_stops import _fake_mesh

    seen: list[dict[str, Any]] = []
    _fake_mesh(monkeypatch, seen)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    train_mod.train(None, ["coordinator.ledger_path=~/ledgers/a.sqlite"], run_dir=tmp_path / "run", report=False)
    assert seen[0]["cfg"].coordinator.ledger_path == str(tmp_path / "home" / "ledgers" / "a.sqlite")


def test_a_relative_checkpoint_dir_names_the_same_directory_when_the_run_is_resumed_from_elsewhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """trainer.default_local_dir=ckpts (and the other output directories: param_server.disk_dir)
    stayed relative in what the services got and in config.resolved.yaml: the trainer replica
    (and its rank actors, which write the shards) resolved it against their own working
    directory, and `meshrl train --resume` from another directory found no checkpoint there and
    started at step 0, its ResumeTrainer(0) sending every consumed group back. The driver makes
    every path-valued key absolute against its cwd, as `meshrl serve-config` does."""
    from tests.unit.test_train_cli_stops import _fake_mesh

    seen: list[dict[str, Any]] = []
    _fake_mesh(monkeypatch, seen)
    for d in ("home", "elsewhere"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "home")
    run_dir = tmp_path / "run"
    train_mod.train(None, ["trainer.default_local_dir=ckpts", "param_server.disk_dir=weights"],
                    run_dir=run_dir, report=False)
    ckpts, weights = str(tmp_path / "home" / "ckpts"), str(tmp_path / "home" / "weights")
    monkeypatch.chdir(tmp_path / "elsewhere")
    train_mod.train(None, [], resume=run_dir, report=False)
    for got in seen:
        cfg = got["cfg"]
        assert cfg.trainer.default_local_dir == ckpts
        assert cfg.trainer_service.loop.default_local_dir == ckpts  # what the trainer reads
        assert cfg.param_server.disk_dir == weights
    resolved = load_config(run_dir / "config.resolved.yaml")
    assert resolved.trainer.default_local_dir == ckpts


def test_a_config_file_given_with_resume_is_refused_not_silently_ignored(tmp_path: Path) -> None:
    """`meshrl train my.yaml --resume RUN_DIR` loaded RUN_DIR/config.resolved.yaml and never read
    my.yaml: a changed config (a fixed learning rate, more epochs) was silently not applied to
    the resumed run. Changes to a resumed run are dotted overrides."""
    from services.common.config import write_resolved_config
    from services.common.errors import ConfigError

    run_dir = tmp_path / "run"
    write_resolved_config(resolve_config(None, []), run_dir)
    changed = tmp_path / "changed.yaml"
    changed.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-07\n")
    with pytest.raises(ConfigError, match=r"changed\.yaml.*--resume.*overrides"):
        resolve_config(str(changed), [], resume=run_dir)
    assert resolve_config(None, ["actor_rollout_ref.actor.optim.lr=1e-7"], resume=run_dir).actor_rollout_ref.actor.optim.lr == 1e-7


_LEDGER_REFUSAL = (
    "FailedPrecondition: ledger {path} does not exist, and this coordinator continues a run (`meshrl train "
    "--resume`, `meshrl coordinator serve --resume`, or Serve restarting its replica): a new ledger would start "
    "it over from prompt 0; point coordinator.ledger_path at the run's ledger (ledger.sqlite in its run "
    "directory, or where its volume is mounted now), or start a new run (without --resume; a new `meshrl "
    "serve-config`)"
)


@pytest.mark.parametrize("failed,needle", [
    ("coordinator", "coordinator.ledger_path"),
    ("rollout", "actor_rollout_ref.model.path"),
])
def test_a_replica_that_does_not_start_is_the_error_meshrl_train_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failed: str, needle: str
) -> None:
    """serve.run_many raises Serve's generic "Deploying application X failed: Failed to update the
    deployments [...]" once a replica's constructor failed its retries; the replica's own error
    (logged into the run's logs by log_init_errors) is what the user must read. It was appended
    after a "did not start" line for EVERY application of the wave (all five by default: the
    healthy ones said "no error logged", or an error a previous session logged) and the whole cut
    at 500 characters, so `meshrl train --resume` on a missing ledger printed neither the refusal
    nor coordinator.ledger_path, and a rollout's bad model path was cut off behind four lines about
    services that had started."""
    from ray import serve

    from services.common import serve_util
    from services.trainer import ranks

    run_dir = tmp_path / ("runs-of-a-team-on-a-shared-volume/fully_async-20261207-233000" + "-x" * 20)
    logs = run_dir / "logs"
    logs.mkdir(parents=True)
    ledger = run_dir / "ledger.sqlite"
    errors = {"coordinator": _LEDGER_REFUSAL.format(path=ledger),
              "rollout": "InvalidArgument: actor_rollout_ref.model.path: /models/qwen3-8b is not a model directory"}
    deployments = {"coordinator": "Coordinator", "rollout": "RolloutDeployment"}

    def run_many(targets: list[Any]) -> None:
        raise RuntimeError(f"Deploying application {failed} failed: Failed to update the deployments "
                           f"['{deployments[failed]}'].")

    def status() -> Any:
        apps = {}
        for name in ("coordinator", "param_server", "reward", "rollout", "trainer"):
            state = "DEPLOY_FAILED" if name == failed else "RUNNING" if name != "trainer" else "DEPLOYING"
            message = (f"The deployment failed to start 3 times in a row. This may be due to a problem with its "
                       f"constructor or initial health check failing. See controller logs for details. Error:\n"
                       f"Traceback (most recent call last):\n  File \"x.py\", line 1\n{errors[failed]}"
                       if name == failed else "")
            apps[name] = SimpleNamespace(status=state, message="", deployments={
                deployments.get(name, name): SimpleNamespace(status=state, message=message)})
        return SimpleNamespace(applications=apps)

    monkeypatch.setattr(serve_util, "init_ray", lambda *a, **k: None)
    monkeypatch.setattr(serve_util, "start_serve", lambda *a, **k: (lambda: None))
    monkeypatch.setattr(ranks, "spawn_for", lambda cfg, **k: None)
    monkeypatch.setattr(serve, "run_many", run_many)
    monkeypatch.setattr(serve, "status", status)
    cfg = resolve_config(None, ["serve.ray_address=auto", "serve.parallel_deploy=true"])
    run = MeshRun(cfg, run_dir, "fully_async", resume=True)
    # a previous session's trainer logged an error; this session's trainer is only still starting
    old = logs / "trainer.111.jsonl"
    old.write_text(json.dumps({"event": "commit_failed", "level": "error", "error": "old"}) + "\n")
    os.utime(old, (run.started - 3600, run.started - 3600))
    (logs / f"{failed}.222.jsonl").write_text(json.dumps(
        {"event": "replica_init_failed", "level": "error", "error": errors[failed]}) + "\n")
    with pytest.raises(RuntimeError) as caught:
        run.deploy()
    reason = train_mod._failed(run, caught.value).reason
    assert needle in reason, reason
    assert reason.startswith(f"RuntimeError: {failed} did not start"), reason
    for other in {"coordinator", "param_server", "reward", "rollout", "trainer"} - {failed}:
        assert f"{other} did not start" not in reason, reason


def test_a_coordinator_replica_serve_cannot_restart_is_reported_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mid-run the ledger is deleted: the coordinator fails its health check, and each replacement
    Serve starts refuses the missing ledger (a Serve restart continues the session's run). The
    driver reported only the application's message ("The deployments ['Coordinator'] are
    UNHEALTHY."), once per status change (the health-check failure, not the refusals after it,
    which leave the status UNHEALTHY), and stopped 300 s later with "the coordinator has not
    answered" and the gRPC error: nowhere the refusal or coordinator.ledger_path."""
    from ray import serve

    from meshrl.watchdog import OUTAGE_LIMIT_S, RunFailure

    refusal = _LEDGER_REFUSAL.format(path=tmp_path / "ledger.sqlite")
    deployment = {"message": "The replica failed its health check 3 times: ledger unreadable"}

    def status() -> Any:
        app = SimpleNamespace(status="UNHEALTHY", message="The deployments ['Coordinator'] are UNHEALTHY.",
                              deployments={"Coordinator": SimpleNamespace(status="UNHEALTHY", **deployment)})
        return SimpleNamespace(applications={"coordinator": app})

    monkeypatch.setattr(serve, "status", status)
    cfg = resolve_config(None, ["serve.ray_address=auto"])
    run = MeshRun(cfg, tmp_path, "fully_async")
    run.watchdog.started = 0.0
    run.watchdog.coordinator_failed(100.0, "UNAVAILABLE: failed to connect to all addresses")
    asyncio.run(run._check_serve(100.0))
    deployment["message"] = ("A replica failed to start with exception. Retrying. Error:\nTraceback (most recent "
                             f"call last):\n  File \"deployment.py\", line 67\n{refusal}")
    asyncio.run(run._check_serve(110.0))
    assert any("coordinator.ledger_path" in i["detail"] for i in run.watchdog.incidents), run.watchdog.incidents
    with pytest.raises(RunFailure) as caught:
        run.watchdog.coordinator_failed(101.0 + OUTAGE_LIMIT_S, "UNAVAILABLE: failed to connect to all addresses")
    assert "coordinator.ledger_path" in str(caught.value), caught.value
