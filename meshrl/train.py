"""`meshrl train`: start the five services as Ray Serve applications on a local (or given) Ray,
wire them together, watch the run, and leave a complete run directory behind.

Who waits for whom:

    driver ── start Serve (gRPC ingress) ── coordinator, param_server, reward ── trainer ── rollout
      │                                                                            │          │
      │   rollout: LeasePrompts → generate → Score (reward handle) → SubmitGroups ─┘          │
      │   trainer: FetchBatch → step → publish (param server) → CommitVersion ───────────────┘
      │   rollout: WatchVersions → fetch → load
      └── polls GetStatus + the trainer's status; validates every trainer.test_freq versions;
          on Ctrl-C: Stop (trainer checkpoints and exits), rollouts return their leases;
          at the end: ledger audit, summary.json, report.html, Serve and Ray shut down.

Modes run the same services: `fully_async` (the staleness budget), `one_step_off` (staleness 1,
trigger 1, no partial rollout: a whole batch generated with the previous weights) and `sync`
(staleness 0, trigger 1: lock-step).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.config import MeshConfig, derive, load_config, write_resolved_config
from services.common.config.trainer_loop import run_length
from services.common.errors import ConfigError, first_cause
from services.common.logging import get_logger
from services.common.serve_util import APP_LOGGING, free_port, port_is_free

from .tokens import prepare_run_secrets
from .watchdog import RunFailed, RunFailure, Watchdog

if TYPE_CHECKING:
    from services.trainer.ranks import SpawnedRanks

log = get_logger(__name__)

EXAMPLE_CONFIG = Path(__file__).resolve().parent / "configs" / "example.yaml"
APPS = ("coordinator", "param_server", "reward", "rollout", "trainer")
HANDLE_TIMEOUT_S = 10.0
"""Deadline of the driver's status calls on a Serve handle: a replica being replaced does not
hold up the watch loop (the watchdog bounds how long it may stay away)."""

MODE_OVERRIDES: dict[str, list[str]] = {
    "fully_async": ["async_training.mode=fully_async"],
    "one_step_off": [
        "async_training.mode=one_step_off", "async_training.staleness_threshold=1.0",
        "async_training.trigger_parameter_sync_step=1", "async_training.partial_rollout=false",
        "async_training.max_staleness_versions=1",
    ],
    "sync": ["async_training.mode=sync", "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1"],
}


def resolve_config(
    config: str | None, overrides: list[str], *, mode: str | None = None, resume: Path | None = None
) -> MeshConfig:
    """The run's config: the resumed run's resolved config, else CONFIG (or the built-in
    example), then the mode's settings, then the user's overrides."""
    base: str | Path
    if resume is not None:
        if config is not None:
            # Never read: a changed config (a fixed learning rate, more epochs) silently not applied.
            raise ConfigError(f"{config}: --resume {resume} continues that run with its config.resolved.yaml and "
                              "reads no config file; leave it out and give the changes as dotted overrides")
        base = resume / "config.resolved.yaml"
        if not base.exists():
            raise FileNotFoundError(f"{resume} has no config.resolved.yaml; is it a meshrl run directory?")
    else:
        base = config or EXAMPLE_CONFIG
    mode_overrides = MODE_OVERRIDES[mode] if mode else []
    # A dump's trainer.total_epochs is already in its rollout.total_epochs (resolve._total_epochs).
    # Dumps written before that rule hold `trainer.total_epochs: 1`, a field nothing read then,
    # which would now be refused as disagreeing with the rollout.total_epochs the run used.
    carried = ["trainer.total_epochs=null"] if resume is not None else []
    return load_config(base, [*carried, *mode_overrides, *overrides])


def ensure_model(cfg: MeshConfig) -> MeshConfig:
    """With `actor_rollout_ref.model.path` null: the built-in warm start (meshrl pretrain); a hub
    id (`Qwen/Qwen3-8B`, also as `tokenizer_path`): its local snapshot (services/common/hub.py)."""
    model = cfg.actor_rollout_ref.model
    if model.path is not None:
        from services.common.hub import resolve_model_path

        update = {"path": resolve_model_path(model.path)}
        if model.tokenizer_path is not None:
            update["tokenizer_path"] = resolve_model_path(model.tokenizer_path,
                                                          key="actor_rollout_ref.model.tokenizer_path")
        return cfg.model_copy(update={"actor_rollout_ref": cfg.actor_rollout_ref.model_copy(
            update={"model": model.model_copy(update=update)})})
    from meshrl.pretrain import PretrainSpec, ensure_pretrained

    syn = cfg.data.synthetic
    spec = (PretrainSpec.for_task(syn.name, digits=syn.digits, length_tail_alpha=syn.length_tail_alpha,
                                  max_digits=syn.max_digits) if syn is not None else PretrainSpec())
    path = ensure_pretrained(spec)
    return cfg.model_copy(update={"actor_rollout_ref": cfg.actor_rollout_ref.model_copy(
        update={"model": cfg.actor_rollout_ref.model.model_copy(update={"path": str(path)})})})


def wire(cfg: MeshConfig, grpc_port: int) -> MeshConfig:
    """Point every service at the others through Serve's gRPC ingress and the param server."""
    address = f"127.0.0.1:{grpc_port}"
    data = cfg.model_dump(mode="json")
    data["rollout_worker"].update(coordinator_address=address, coordinator_application="coordinator",
                                  reward_application="reward")
    data["trainer_service"].update(coordinator_address=address, coordinator_application="coordinator",
                                   publisher="param_server")
    data["serve"]["grpc_port"] = grpc_port
    ps, given = data["param_server"], cfg.param_server
    if given.port and given.host in ("127.0.0.1", "localhost") and not given.advertise_address \
            and ("port" not in given.model_fields_set or not port_is_free(given.port)):
        # A loopback param server on the default port (or a held one) gets a free port, so that two
        # local runs never meet on 50071 (before SO_REUSEPORT was turned off they silently shared
        # it and fetched each other's weights; now the second would fail to bind).
        ps["port"] = free_port()
    return MeshConfig.model_validate(data)


def _app_builders() -> list[tuple[str, Callable[..., Any]]]:
    """Each application's name and `build_app`, in deploy order."""
    from services.coordinator.deployment import build_app as coordinator_app
    from services.param_server.deployment import build_app as param_server_app
    from services.reward.deployment import build_app as reward_app
    from services.rollout.deployment import build_app as rollout_app
    from services.trainer.deployment import build_app as trainer_app

    return [("coordinator", coordinator_app), ("param_server", param_server_app), ("reward", reward_app),
            ("rollout", rollout_app), ("trainer", trainer_app)]


@dataclass
class Progress:
    """What the driver knows about the run at one moment."""

    step: int = 0
    total_steps: int = 0
    policy_version: int = 0
    reward_mean: float | None = None
    staleness_mean: float | None = None
    tokens_per_s: float | None = None
    trainer_state: str = "starting"
    elapsed_s: float = 0.0
    queued: int = 0
    in_flight: int = 0
    val_score: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    first_step: int = 0
    first_step_elapsed_s: float = 0.0
    """The step this driver first saw and when: a resumed run starts at its checkpoint's step,
    and the ETA's pace counts only the steps trained since."""

    @property
    def eta_s(self) -> float | None:
        done = self.step - self.first_step
        if done <= 0 or self.total_steps <= 0:
            return None
        return (self.elapsed_s - self.first_step_elapsed_s) / done * max(0, self.total_steps - self.step)


class MeshRun:
    """One `meshrl train` run: deploy, watch, stop, summarize."""

    def __init__(
        self, cfg: MeshConfig, run_dir: Path, mode: str, *, max_train_s: float | None = None,
        secret_env: dict[str, str] | None = None, resume: bool = False,
    ) -> None:
        self.cfg = cfg
        self.resume = resume
        """`meshrl train --resume`: the coordinator refuses to start on a ledger that is not there."""
        self.secret_env = secret_env or {}
        self.max_train_s = max_train_s
        self._first_step_seen: float | None = None
        self._time_stop_sent = False
        self.run_dir = run_dir
        self.mode = mode
        self.started = time.time()
        self.grpc_port = cfg.serve.grpc_port
        self.derived = derive(cfg)
        from services.common.data import val_dataset
        from services.environment.factory import prompt_tools

        # Read (and its rows checked) before anything starts, once: read at each validation, a bad
        # row stopped the run at the first one, test_freq versions in with val_before_train=false.
        self.val = (val_dataset(cfg.data, cfg.actor_rollout_ref.model, prompt_tools(cfg))
                    if cfg.trainer.test_freq > 0 else None)
        self._val_versions: set[int] = set()
        self._stop_requested = False
        self._stop_sent_at: float | None = None
        self._stop_reported = 0.0
        self.interrupts = 0
        self._rollout_prev: dict[str, Any] = {}  # replica id -> its last GetRolloutStatusResponse
        self._first_step: tuple[int, float] | None = None  # (step, elapsed_s) of the trainer's first answer
        ts = cfg.trainer_service
        self.watchdog = Watchdog(str(run_dir), max_restarts=ts.max_restarts, restart_timeout_s=ts.restart_timeout_s,
                                 started=self.started)
        self.deployed = False
        self._rollouts_stopped = False
        self.final_status: Any = None
        self._last_status: Any = None
        self._last_trainer: dict[str, Any] = {}
        self._serve_checked = 0.0
        self.startup: dict[str, Any] = {}
        """Seconds of each start-up phase (Ray and Serve, each deploy wave): in summary.json."""
        self.early_ranks: SpawnedRanks | None = None
        """The trainer's rank actors, asked for before Serve starts (`deploy`); this driver owns them."""

    # ---- lifecycle -----------------------------------------------------------------------------

    def deploy(self) -> None:
        from ray import serve
        from ray.serve.schema import LoggingConfig

        from services.common.priority import renice_ray_system
        from services.common.serve_util import init_ray, start_serve

        # Serve's per-application INFO lines ("Application 'x' is ready") would scroll the
        # progress display away; failures still come through as warnings and errors.
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        # Logical CPUs for a local Ray: Serve replicas and rank actors reserve CPU shares to be
        # placed, not to be fast; 8 lets the five services fit on a 2-core laptop.
        t0 = time.monotonic()
        # The applications' modules (torch among their imports: seconds) load in a thread while
        # Ray and Serve start, which mostly wait on their daemons and actors.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="app-imports") as pool:
            builders = pool.submit(_app_builders)
            init_ray(self.cfg.serve.ray_address, num_cpus=self.cfg.serve.num_cpus or max(8, os.cpu_count() or 1),
                     log_to_driver=False, env=self.secret_env, bytecode_cache=self.cfg.serve.bytecode_cache)
            # The trainer's ranks are asked for now, before Serve: their processes load torch and
            # the model libraries (the longest part of a trainer's start) while Serve starts and
            # deploys; the trainer replica claims them (services/trainer/ranks.py).
            from services.trainer.ranks import spawn_for

            self.early_ranks = spawn_for(self.cfg, outside_replica=True)
            self.startup["ranks_asked_s"] = round(time.monotonic() - t0, 2)
            # The applications deploy while Serve's proxies start (start_serve's wait_for_proxies).
            proxies_ready = start_serve(
                self.grpc_port, http_port=self.cfg.serve.http_port if port_is_free(self.cfg.serve.http_port)
                else free_port(), request_timeout_s=self.cfg.serve.request_timeout_s,
                proxy_location=self.cfg.serve.proxy_location, wait_for_proxies=False)
            if not self.cfg.serve.ray_address:  # a Ray of our own: its daemons may step back
                renice_ray_system(self.cfg.tuning.nice.ray_daemons, key="tuning.nice.ray_daemons")
            self.startup["ray_and_serve_s"] = round(time.monotonic() - t0, 2)
            apps = builders.result()
        # One session per `meshrl train`: a Stop from an earlier session (Ctrl-C) does not stop a resume.
        args = {"config": self.cfg.model_dump(mode="json"), "run_dir": str(self.run_dir),
                "session": uuid.uuid4().hex, "ranks": self.early_ranks, "resume": self.resume}
        quiet = LoggingConfig(**APP_LOGGING)
        # Every application at once (serve.run_many returns when every replica is healthy), as
        # `serve deploy` of `meshrl serve-config` starts them: a rollout or trainer replica spends
        # its first seconds spawning and importing, by which time the coordinator, param server and
        # reward it calls are up (and its clients retry until they are), so the engine load, the
        # rank start-up and model build overlap the others' start (BENCHMARKS.md, "Start-up").
        waves = [apps] if self.cfg.serve.parallel_deploy else [[app] for app in apps]
        for wave in waves:
            t0 = time.monotonic()
            targets = [serve.RunTarget(builder(args), name=name, route_prefix=f"/{name}", logging_config=quiet)
                       for name, builder in wave]
            try:
                serve.run_many(targets)
            except RuntimeError as exc:
                proxies_ready()  # a proxy that failed to start (its port taken) is the error to report
                raise RuntimeError(_not_started(self.run_dir, [name for name, _ in wave], exc, self.started)) from None
            self.startup["deploy_" + "+".join(name for name, _ in wave) + "_s"] = round(time.monotonic() - t0, 2)
        proxies_ready()
        if not self.cfg.serve.ray_address:  # the proxies, which started beside the deploy, step back too
            renice_ray_system(self.cfg.tuning.nice.ray_daemons, key="tuning.nice.ray_daemons")
        self.deployed = True
        from services.common.startup import timeline

        # Each service process's own phases (spawn and imports, engine build, rank start-up, ...)
        # on this run's clock: where the waves above spent their time.
        self.startup["timeline"] = timeline(self.run_dir / "logs", self.started)
        from meshrl.prometheus import write_service_discovery

        sd = write_service_discovery(self.run_dir, {"job": "meshrl", "run": self.run_dir.name})
        log.info("mesh_deployed", apps=list(APPS), grpc=f"127.0.0.1:{self.grpc_port}", prometheus_sd=str(sd))

    def stop_rollouts(self) -> None:
        """Take the rollout replicas down: each returns its unfinished leases on the way out (a
        multi-turn trajectory can still be mid-conversation when the trainer stops), so the ledger
        audit that follows sees them back in the queue."""
        import ray
        from ray import serve

        if self._rollouts_stopped or not ray.is_initialized():
            return  # nothing deployed: Serve's calls would join (or start) whatever Ray this host runs
        self._rollouts_stopped = True
        try:
            serve.delete("rollout")
        except Exception as exc:  # noqa: BLE001 -- best effort on the way down
            log.warning("rollout_delete_failed", error=str(exc))

    def shutdown(self) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return  # Ray never started (or the start failed): nothing of ours runs anywhere
        self.stop_rollouts()
        if self.cfg.serve.ray_address:
            serve.shutdown()  # a cluster we joined: take our applications down, leave Ray up
        # A local Ray we started goes down whole (every replica with it; the ledger is durable at
        # each transaction). serve.shutdown() first would kill the controller under this
        # driver's router, and the raylet prints "actor is dead" errors for its pending calls.
        ray.shutdown()

    # ---- watching ------------------------------------------------------------------------------

    async def poll(self, client: Any) -> Progress:
        """One look at the run. A coordinator or trainer being restarted by Serve is waited for
        (the watchdog says so and bounds the wait); the last answer stands in meanwhile."""
        import grpc
        from ray import serve

        now = time.time()
        try:
            status = await client.status()
        except grpc.RpcError as exc:
            self.watchdog.coordinator_failed(now, first_cause(exc))
            status = self._last_status
        else:
            self._last_status = status
            self.watchdog.coordinator_ok(now, status)
        try:
            reply = await asyncio.wait_for(serve.get_app_handle("trainer").status.remote(), HANDLE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- any failure of the handle call: the replica is being replaced
            self.watchdog.trainer_unreachable(now, first_cause(exc))
            trainer = {**self._last_trainer, "state": "restarting"}
        else:
            trainer = {"state": reply.state, "step": int(reply.step), "error": reply.error, "replica": reply.replica,
                       "metrics": dict(reply.metrics)}
            self._last_trainer = trainer
            # the baseline is the step the trainer resumed at: while it still loads its checkpoint
            # ("created", "starting") it answers step 0
            if self._first_step is None and reply.state not in ("created", "starting"):
                self._first_step = (trainer["step"], time.time() - self.started)
        state = self.watchdog.trainer_state(now, trainer) if trainer.get("state") != "restarting" else "restarting"
        m = trainer.get("metrics", {})
        totals = status.totals if status is not None else None
        p = Progress(
            step=int(trainer.get("step", 0)), total_steps=self._total_steps(status),
            policy_version=int(status.policy_version) if status is not None else 0,
            reward_mean=m.get("critic/rewards/mean"), staleness_mean=m.get("staleness/mean"),
            tokens_per_s=m.get("perf/throughput_tokens_per_s"), trainer_state=state,
            elapsed_s=time.time() - self.started,
            queued=int(totals.queued) if totals is not None else 0,
            in_flight=int(totals.in_flight) if totals is not None else 0,
        )
        if self._first_step is not None:
            p.first_step, p.first_step_elapsed_s = self._first_step
        await self._check_serve(now)
        try:
            await asyncio.wait_for(self._sample_rollout(), HANDLE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- metrics only: a replica being replaced is sampled next time
            log.debug("rollout_sample_failed", error=first_cause(exc))
        return p

    def _total_steps(self, status: Any) -> int:
        """Trainer steps of the run. The config alone caps it at rollout.total_rollout_steps
        prompts; the coordinator's prompts_total is also capped at len(data) * rollout.total_epochs
        (as the trainer's total_steps is), and the driver does not read the data to know it."""
        prompts = int(status.totals.prompts_total) if status is not None else 0
        if prompts <= 0:  # not heard from the coordinator yet
            return self.derived.total_local_steps
        at = self.cfg.async_training
        _, versions = run_length(
            required=self.derived.required_samples, trigger=at.trigger_parameter_sync_step, total_rollout_steps=prompts,
            total_epochs=self.cfg.rollout.total_epochs, total_training_steps=self.cfg.trainer.total_training_steps,
            dataset_size=None,
        )
        return versions * at.trigger_parameter_sync_step

    async def _check_serve(self, now: float) -> None:
        """Every 10 s: Serve's view of each application (a replica crash-looping shows here)."""
        if now - self._serve_checked < 10.0:
            return
        self._serve_checked = now
        from ray import serve

        try:
            st = await asyncio.wait_for(asyncio.to_thread(serve.status), HANDLE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- reporting only
            log.debug("serve_status_failed", error=first_cause(exc))
            return
        self.watchdog.serve_status(now, {name: (_status(app.status), _app_message(app))
                                         for name, app in st.applications.items()})

    async def _sample_rollout(self) -> None:
        """One rollout replica's counters -> metrics/rollout.jsonl (idle ratio since the last
        sample of that replica). The handle picks a replica; over time every one is sampled."""
        from ray import serve

        st = await serve.get_app_handle("rollout").status.remote()
        rid = st.replica_id
        prev = self._rollout_prev.get(rid)
        self._rollout_prev[rid] = st
        if prev is None:
            return
        dt = st.uptime_s - prev.uptime_s
        if dt <= 0:
            return
        rec = {
            "time": time.time(), "time_s": round(time.time() - self.started, 3), "replica_id": rid,
            "rollout/idle_ratio": max(0.0, 1.0 - (st.busy_s - prev.busy_s) / dt),
            "rollout/interval_s": dt, "rollout/busy_s": st.busy_s - prev.busy_s,
            "rollout/tokens_per_s": (st.tokens_generated - prev.tokens_generated) / dt,
            "rollout/policy_version": st.policy_version, "rollout/groups_in_flight": st.groups_in_flight,
            "rollout/weight_load_s": st.last_weight_load_s,
            **{f"rollout/{k}": v for k, v in st.engine_stats.items() if k.startswith("weights/")},  # delta sync, sharded fetch
        }
        path = self.run_dir / "metrics" / "rollout.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    async def validate(self, version: int) -> dict[str, Any] | None:
        """Score the held-out split with the current rollout weights (rollout.val_kwargs)."""
        from .validation import run_validation

        if self.val is None:
            return None
        return await run_validation(self.cfg, self.val, version, self.run_dir, self.started)

    async def watch(self, on_progress: Callable[[Progress], None]) -> Progress:
        """Poll until the trainer finishes; a failure the watchdog cannot wait out stops the run
        (a clean stop where the trainer still runs: it checkpoints at its next step)."""
        from services.coordinator.client import CoordinatorClient

        test_freq = self.cfg.trainer.test_freq
        async with CoordinatorClient(f"127.0.0.1:{self.grpc_port}", application="coordinator") as client:
            if self.cfg.trainer.val_before_train and test_freq > 0:
                await self._maybe_validate(0)
            progress = await self.poll(client)
            val_due = 0
            while progress.trainer_state not in ("finished", "failed"):
                if self.watchdog.failure is not None and self._stop_sent_at is None:
                    self._stop_requested = True
                if self._stop_requested:
                    await self._send_stop(client)
                await asyncio.sleep(1.0)
                try:
                    progress = await self.poll(client)
                except RunFailure as exc:
                    self.watchdog.stop(time.time(), str(exc))
                    break
                self._report_slow_stop(progress)
                self._check_time_limit(progress)
                # Every test_freq versions: at the first poll past each multiple (a poll can
                # miss the exact version while the trainer runs ahead), with the version then live.
                try:
                    if test_freq > 0 and progress.policy_version // test_freq > val_due:
                        val_due = progress.policy_version // test_freq
                        await self._maybe_validate(progress.policy_version)
                    on_progress(progress)
                except Exception as exc:  # noqa: BLE001 -- a tracker gone, a validation error: a clean stop
                    # (raised here, train() would shut Ray down under a healthy trainer: every step
                    # since its last checkpoint lost)
                    self.watchdog.stop(time.time(), f"the driver failed: {first_cause(exc)}")
            if self.watchdog.failure is not None:
                await self._send_stop(client)  # rollouts stop leasing; the stop is this session's only
            elif test_freq > 0:
                await self._maybe_validate(progress.policy_version)
            try:
                self.final_status = await client.status()
            except Exception as exc:  # noqa: BLE001 -- a failed run's summary uses the last status seen
                log.warning("final_status_failed", error=first_cause(exc))
                self.final_status = self._last_status
            return progress

    async def _send_stop(self, client: Any) -> None:
        self._stop_requested = False
        try:
            await client.stop()
        except Exception as exc:  # noqa: BLE001 -- the coordinator may be the part that failed
            log.warning("stop_failed", error=first_cause(exc), hint="sent again at the next poll")
            self._stop_requested = True  # (a coordinator restarting under Serve takes it a moment later)
            return
        self._stop_sent_at = self._stop_sent_at or time.monotonic()

    def _report_slow_stop(self, progress: Progress) -> None:
        """After a stop, say every 30 s what the run still waits for (the trainer's last step
        and checkpoint, rollouts returning leases) instead of going quiet."""
        if self._stop_sent_at is None:
            return
        waited = time.monotonic() - self._stop_sent_at
        if waited - self._stop_reported >= 30.0:
            self._stop_reported = waited
            log.warning("stop_in_progress", waited_s=round(waited), trainer_state=progress.trainer_state,
                        step=progress.step, in_flight=progress.in_flight, queued=progress.queued,
                        hint="the trainer finishes its step and checkpoints; Ctrl-C again aborts")

    def _check_time_limit(self, progress: Progress) -> None:
        """With max_train_s: a clean stop once that many seconds passed since the first step was seen."""
        if self.max_train_s is None or progress.step <= 0 or self._time_stop_sent:
            return
        now = time.time()
        if self._first_step_seen is None:
            self._first_step_seen = now
        elif now - self._first_step_seen >= self.max_train_s:
            log.warning("time_limit_stop", max_train_s=self.max_train_s, step=progress.step)
            self._time_stop_sent = True
            self.request_stop()

    async def _maybe_validate(self, version: int) -> None:
        if version in self._val_versions:
            return
        self._val_versions.add(version)
        from ray.exceptions import ActorUnavailableError, RayActorError

        try:
            rec = await self.validate(version)
        except (RayActorError, ActorUnavailableError) as exc:
            # A rollout replica died under the call: Serve replaces it; this validation is skipped
            # (any other error is the run's: it fails with the cause).
            log.warning("validation_skipped", policy_version=version, error=first_cause(exc))
            return
        if rec is not None:
            log.info("validation", policy_version=version, score=rec["val/score"])

    def request_stop(self) -> None:
        self._stop_requested = True

    # ---- the end -------------------------------------------------------------------------------

    def summarize(self, progress: Progress) -> dict[str, Any]:
        from google.protobuf.json_format import MessageToDict
        from ray import serve

        try:
            audit = serve.get_app_handle("coordinator").audit.remote().result(timeout_s=120)
        except Exception as exc:  # noqa: BLE001 -- a failed run still gets its summary
            audit = {"balanced": False, "error": first_cause(exc), "lost": [], "duplicated": []}
        final = self.final_status
        if final is None:
            from meshrl.v1 import coordinator_pb2

            final = coordinator_pb2.GetStatusResponse()
        status = MessageToDict(final, preserving_proto_field_name=True)
        rewards = _rewards(self.run_dir)
        k = max(1, len(rewards) // 10)
        summary = {
            "mode": self.mode,
            "run_dir": str(self.run_dir),
            "started_unix_s": self.started,
            "wall_s": round(time.time() - self.started, 2),
            "steps": progress.step,
            "policy_versions": int(final.policy_version),
            "reward_first_10pct": sum(rewards[:k]) / k if rewards else None,
            "reward_last_10pct": sum(rewards[-k:]) / k if rewards else None,
            "staleness_histogram": {str(b.staleness): int(b.groups) for b in final.staleness_histogram},
            "max_staleness_seen": max((b.staleness for b in final.staleness_histogram), default=0),
            "audit": {k2: v for k2, v in audit.items() if k2 not in ("lost", "duplicated")}
            | {"lost": len(audit["lost"]), "duplicated": len(audit["duplicated"])},
            "totals": status.get("totals", {}),
            "startup_s": self.startup,
            **self.watchdog.summary(),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


_FAILED = ("DEPLOY_FAILED", "UNHEALTHY")


def _not_started(run_dir: Path, names: list[str], exc: Exception, since: float) -> str:
    """Why a deploy wave failed, the replica's own error first: serve.run_many's error ("Deploying
    application X failed: Failed to update the deployments [...]") names no cause, and the
    reason `meshrl train` prints is cut at 500 characters (first_cause). Only the applications
    Serve reports failed are named (every one of the wave when Serve cannot say): the others of
    a parallel deploy started or are still starting, and a "did not start: no error logged" line
    for each came first and pushed the cause (a missing ledger's coordinator.ledger_path, a bad
    model path) out of what was printed."""
    from ray import serve

    try:
        apps = serve.status().applications
    except Exception:  # noqa: BLE001 -- Serve's own error below still says which failed
        apps = {}
    serve_says: dict[str, str] = {}
    for name in names:
        app = apps.get(name)
        if app is None or _status(app.status) not in _FAILED:
            continue
        errors = list(_deployment_errors(app).values())
        serve_says[name] = errors[-1] if errors else str(app.message or "")
    failed = list(serve_says) or names
    errors = [f"{name} did not start: {_last_error(run_dir, name, since) or serve_says.get(name) or _no_error(run_dir)}"
              for name in failed]
    return "\n".join([*errors, str(exc)])


def _status(status: Any) -> str:
    return str(getattr(status, "value", status))


def _app_message(app: Any) -> str:
    """An application's message, and the error of each deployment not healthy: the application's
    own says only "The deployments [...] are UNHEALTHY"; a deployment's ends with its replica's
    exception (the last line of a traceback), e.g. a restarted coordinator refusing a ledger that
    is gone (coordinator.ledger_path)."""
    parts = [" ".join(str(app.message or "").split())[:300]]
    parts += [f"{name}: {error[:500]}" for name, error in _deployment_errors(app).items()]
    return "; ".join(p for p in parts if p)


def _deployment_errors(app: Any) -> dict[str, str]:
    """The error of each deployment of an application that failed or is unhealthy: the last line
    of its message, which ends with its replica's exception (the last line of a traceback). One
    still updating may say "slow to start" with a count, which changes on every poll: left out."""
    errors: dict[str, str] = {}
    for name, d in (getattr(app, "deployments", None) or {}).items():
        lines = [line.strip() for line in str(d.message or "").splitlines() if line.strip()]
        if _status(d.status) in _FAILED and lines:
            errors[name] = lines[-1]
    return errors


def _no_error(run_dir: Path) -> str:
    return f"no error logged; see {run_dir / 'logs'} and Ray's logs under /tmp/ray/session_latest/logs/serve"


def _last_error(run_dir: Path, service: str, since: float = 0.0) -> str:
    """The last error a service logged in the run directory (the reason a replica did not start),
    in a log written since SINCE (a resumed run's directory holds every earlier session's logs); ""
    when none."""
    for path in sorted((run_dir / "logs").glob(f"{service}.*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True):
        if path.stat().st_mtime < since:
            break
        for line in reversed(path.read_text().splitlines()):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("level") in ("error", "critical"):
                exc = rec.get("exception")
                detail = exc[-1].get("exc_value") if isinstance(exc, list) and exc else rec.get("error")
                return f"{rec.get('event')}: {detail}" if detail else str(rec.get("event"))
    return ""


def _rewards(run_dir: Path) -> list[float]:
    path = run_dir / "metrics" / "trainer.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("critic/rewards/mean") is not None:
                out.append(float(rec["critic/rewards/mean"]))
    return out


def _watch(run: MeshRun, on_progress: Callable[[Progress], None]) -> Progress:
    """Run the watch loop until the trainer finishes. Ctrl-C asks for a clean stop; a second one
    aborts. SIGINT is handled by the event loop (a callback between steps), never as a
    KeyboardInterrupt raised wherever the main thread happens to be: one raised inside a gRPC or
    Serve-handle callback left the future it was completing unresolved, and the watch then waited
    on it forever after the first Ctrl-C."""
    import signal
    import threading

    loop = asyncio.new_event_loop()
    watch = loop.create_task(run.watch(on_progress))

    def on_sigint() -> None:
        run.interrupts += 1
        if run.interrupts > 1:
            watch.cancel()
            return
        log.warning("stopping", hint="press Ctrl-C again to abort without a clean stop")
        run.request_stop()

    handled = threading.current_thread() is threading.main_thread()
    # SIGTERM (a scheduler's preemption, `timeout`, `docker stop`) is a Ctrl-C: a clean stop, then an
    # abort. The handler ray.init installs (sys.exit wherever the main thread is) would take the
    # mesh down with no Stop: every step since the last checkpoint lost, no summary.json.
    sigterm_before = signal.getsignal(signal.SIGTERM) if handled else None
    if handled:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        loop.add_signal_handler(signal.SIGTERM, on_sigint)
    try:
        return loop.run_until_complete(watch)
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None
    finally:
        if handled:
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, sigterm_before if sigterm_before is not None else signal.SIG_DFL)
        loop.close()


def _failed(run: MeshRun, exc: Exception) -> RunFailed:
    """The run broke off on EXC: its traceback goes to logs/driver-error.txt, the cause (one line)
    into summary.json with the resume command when the mesh had started."""
    import traceback

    reason = first_cause(exc)
    logs = run.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "driver-error.txt").write_text("".join(traceback.format_exception(exc)))
    resume = run.watchdog.resume_command if run.deployed else ""
    if run.deployed:
        run.watchdog.stop(time.time(), reason)
        try:
            run.summarize(Progress(step=int(run._last_trainer.get("step", 0))))
        except Exception as summary_exc:  # noqa: BLE001 -- the cause above is what matters
            log.warning("summary_failed", error=first_cause(summary_exc))
    return RunFailed(reason, run.run_dir, resume)


def new_run_dir(cfg: MeshConfig, mode: str) -> Path:
    """runs/<experiment>-<mode>-<time>, with -2, -3 ... when a run started in the same second
    has it (a sweep launched from a script)."""
    base = Path("runs") / f"{cfg.trainer.experiment_name}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    return path


RUN_FILES = ("config.resolved.yaml", "ledger.sqlite", "checkpoints")
"""What makes a directory an earlier run's: a fresh run there would continue its ledger and checkpoints."""


def check_fresh_run_dir(run_dir: Path) -> None:
    """A fresh run (no --resume) must not take over an earlier run's directory: its services would
    start on that run's ledger and newest checkpoint under this config."""
    held = [name for name in RUN_FILES if (run_dir / name).exists()]
    if held:
        raise ConfigError(f"--run-dir {run_dir} holds an earlier run ({', '.join(held)}): continue it with "
                          f"`meshrl train --resume {run_dir}`, or give a new --run-dir")


def check_resume_secrets(cfg: MeshConfig) -> None:
    """A resumed run reads its endpoints' tokens from the variables the first run moved inline
    tokens to (config.resolved.yaml holds no secret): they must be set again."""
    for section, endpoints in (("reward.endpoints", cfg.reward.endpoints), ("environment.endpoints", cfg.environment.endpoints)):
        missing = [ep.token_env for ep in endpoints if ep.token_env and not ep.token and not os.environ.get(ep.token_env)]
        if missing:
            raise ConfigError(f"{section}: export {', '.join(missing)} (the endpoint's token the first run had) "
                              "before --resume; config.resolved.yaml keeps no secret")


def train(
    config: str | None,
    overrides: list[str],
    *,
    run_dir: Path | None = None,
    mode: str | None = None,
    resume: Path | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    report: bool = True,
    max_train_s: float | None = None,
) -> dict[str, Any]:
    """Run a whole job; returns the summary (also written to RUN_DIR/summary.json). With
    max_train_s the run stops cleanly (as on Ctrl-C) that long after its first optimizer step."""
    from meshrl.plan_layout import serve_launch_problems
    from meshrl.serve_config import absolute_paths
    from meshrl.trackers import check_loggers, start_tracking
    from services.common.logging import configure_logging

    cfg = resolve_config(config, overrides, mode=mode, resume=resume)
    if problems := serve_launch_problems(cfg):  # the mesh runs under Serve: checked before anything starts
        raise ConfigError("\n".join(problems))
    check_loggers(cfg.trainer.logger)  # a missing tracker package fails before anything starts
    mode = cfg.async_training.mode
    if resume is not None:
        if run_dir is not None and run_dir.resolve() != resume.resolve():
            raise ConfigError(f"--resume {resume} continues that run in its own directory; --run-dir {run_dir} "
                              "is another: leave --run-dir out")
        check_resume_secrets(cfg)
    run_dir = resume or run_dir or new_run_dir(cfg, mode)
    if resume is None:
        check_fresh_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    os.environ["MESHRL_LOG_DIR"] = str((run_dir / "logs").resolve())
    configure_logging("driver", json=False, level=os.environ.get("MESHRL_LOG_LEVEL", "WARNING"))
    cfg = ensure_model(cfg)
    port = cfg.serve.grpc_port if cfg.serve.grpc_port and port_is_free(cfg.serve.grpc_port) else free_port()
    # Every path the services read made absolute against this cwd (and so kept in
    # config.resolved.yaml): replicas and rank actors resolve a relative one against their own
    # working directory (a joined cluster's: where `ray start` ran), and `--resume` from another
    # directory against that one: a checkpoint dir with no checkpoint (the trainer back at step 0,
    # every consumed group sent back), another ledger. After wire: its port choice reads which
    # keys were given, which absolute_paths' reload marks all.
    cfg = absolute_paths(wire(cfg, port))
    # Fresh tokens per run, passed to the services through the environment: config.resolved.yaml
    # and the applications' Serve config hold no secret.
    cfg, secret_env, restore_env = prepare_run_secrets(cfg, run_dir)
    write_resolved_config(cfg, run_dir)
    try:
        run = MeshRun(cfg, run_dir.resolve(), mode, max_train_s=max_train_s, secret_env=secret_env,
                      resume=resume is not None)
    except BaseException:
        restore_env()  # it reads the val data: a bad row fails here, before anything started
        raise
    follower = start_tracking(cfg, run.run_dir, resumed=resume is not None)
    user_progress = on_progress or (lambda p: None)

    def progressed(p: Progress) -> None:
        if follower is not None:
            follower.pump()  # the trackers get each new metrics line within a poll
        user_progress(p)

    try:
        run.deploy()
        progress = _watch(run, progressed)
        run.stop_rollouts()  # their leases are back in the ledger before the audit
        summary = run.summarize(progress)
    except KeyboardInterrupt:
        if run.deployed:
            log.warning("aborted", resume=run.watchdog.resume_command)
        raise
    except Exception as exc:
        raise _failed(run, exc) from exc
    finally:
        run.shutdown()
        restore_env()
        if follower is not None:
            follower.pump()
            follower.tracking.finish()
    if "tensorboard" not in cfg.trainer.logger:  # else written live by the tracker
        from meshrl.tensorboard import write_tensorboard

        try:
            write_tensorboard(run_dir)
        except ImportError as exc:  # torch.utils.tensorboard needs the tensorboard package
            log.warning("tensorboard_skipped", error=str(exc), hint="pip install tensorboard")
    if report:
        from meshrl.report import write_report

        write_report([run_dir])
    return summary
