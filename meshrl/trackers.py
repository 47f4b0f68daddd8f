"""Experiment trackers for `trainer.logger`, with verl's names and verl's Tracking behaviour.

    console      the terminal progress of `meshrl train` (meshrl/progress.py)
    jsonl        metrics/{trainer,validation,rollout}.jsonl (always written: the report reads them)
    tensorboard  torch.utils.tensorboard, live, into $TENSORBOARD_DIR or <run_dir>/tensorboard
    wandb        wandb.init(project=project_name, name=experiment_name); WANDB_MODE=offline works
    mlflow       experiment = project_name, run = experiment_name; $MLFLOW_TRACKING_URI, else
                 sqlite:///<run_dir>/mlflow.db; `@` in metric names becomes `_at_` (mlflow forbids it)
    swanlab      swanlab.init(project, experiment_name); $SWANLAB_MODE, else cloud with
                 $SWANLAB_API_KEY and offline without; $SWANLAB_LOG_DIR, else <run_dir>/swanlog
    trackio      trackio.init(project, name); $TRACKIO_DIR (trackio's default under ~/.cache)

The driver (not the trainer replica) feeds them: `MetricsFollower` reads the lines the services
append to the run's metrics files and logs each record once, so trainer steps, validation and
rollout samples land in one tracker run. Trainer records are logged at their `step`; validation
and rollout records at the newest trainer step seen (trackers such as wandb need steps that never
go back). A resumed run follows from the end of the files as they were.

`check_loggers` runs before anything starts: an unknown name or a tracker whose package is
missing fails with the `pip install` that fixes it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from services.common.logging import get_logger

log = get_logger(__name__)

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab", "trackio")
"""Every `trainer.logger` name."""

INSTALL = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'meshrl[wandb]'"),
    "mlflow": ("mlflow", "pip install 'meshrl[mlflow]'"),
    "trackio": ("trackio", "pip install 'meshrl[trackio]'"),
    # swanlab declares protobuf<7; meshrl's generated code needs 7, on which swanlab runs.
    "swanlab": ("swanlab", "pip install 'meshrl[swanlab]' && pip install --no-deps swanlab"),
}
"""logger -> (module it imports, the command that installs it)."""

_SKIP = frozenset({"step", "time", "time_s", "replica_id"})


class MissingTracker(ValueError):
    """A `trainer.logger` entry whose library is not installed."""


def check_loggers(names: Iterable[str]) -> None:
    """Fail before the run starts: unknown names and missing packages, each with its fix."""
    for name in names:
        if name not in LOGGERS:
            raise ValueError(f"trainer.logger: unknown logger {name!r}; choose from {', '.join(LOGGERS)}")
        if name in INSTALL:
            module, command = INSTALL[name]
            if importlib.util.find_spec(module) is None:
                raise MissingTracker(f"trainer.logger has {name!r} but the {module!r} package is not installed: "
                                     f"{command} (or remove {name!r} from trainer.logger)")


class Backend(Protocol):
    def log(self, data: Mapping[str, float], step: int) -> None: ...

    def finish(self) -> None: ...


class _Tensorboard:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(os.environ.get("TENSORBOARD_DIR") or run_dir / "tensorboard")
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def log(self, data: Mapping[str, float], step: int) -> None:
        for key, value in data.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, project: str, experiment: str, config: dict[str, Any], run_dir: Path) -> None:
        import wandb

        # One id per run directory: a `--resume` continues the same wandb run, a new run of the
        # same experiment name does not (verl's `{project}--{experiment}` id would resume it).
        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", f"{project}--{experiment}--{run_dir.name}")[:128]
        self.run = wandb.init(project=project, name=experiment, config=config, id=run_id, resume="allow",
                              dir=os.environ.get("WANDB_DIR") or str(run_dir))

    def log(self, data: Mapping[str, float], step: int) -> None:
        self.run.log(dict(data), step=step)

    def finish(self) -> None:
        self.run.finish(exit_code=0)


def mlflow_key(key: str) -> str:
    """mlflow allows `[A-Za-z0-9_\\-. /]` in names; verl maps `@` to `_at_`, the rest becomes `_`."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", key.replace("@", "_at_"))


def flatten(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a/b": "1"} (verl logs the config as mlflow params this way)."""
    out: dict[str, str] = {}
    for k, v in cfg.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out |= flatten(v, key)
        else:
            out[key] = json.dumps(v) if isinstance(v, list | tuple) else str(v)
    return out


class _Mlflow:
    def __init__(self, project: str, experiment: str, config: dict[str, Any], run_dir: Path) -> None:
        import mlflow

        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        mlflow.set_tracking_uri(uri)
        experiment_obj = mlflow.set_experiment(project)
        self.run = mlflow.start_run(experiment_id=experiment_obj.experiment_id, run_name=experiment)
        # mlflow caps a param value at 6000 characters; the long ones (lists of files) are cut.
        mlflow.log_params({mlflow_key(k): v[:6000] for k, v in flatten(config).items()})

    def log(self, data: Mapping[str, float], step: int) -> None:
        self.mlflow.log_metrics({mlflow_key(k): v for k, v in data.items()}, step=step)

    def finish(self) -> None:
        self.mlflow.end_run()


class _Swanlab:
    def __init__(self, project: str, experiment: str, config: dict[str, Any], run_dir: Path) -> None:
        import swanlab

        if os.environ.get("SWANLAB_API_KEY"):
            swanlab.login(os.environ["SWANLAB_API_KEY"])
        self.swanlab = swanlab
        # verl defaults to cloud; without an API key that prompts for a login on stdin, which
        # would hang a run under nohup or CI, so meshrl logs offline then (`swanlab sync` uploads).
        mode = os.environ.get("SWANLAB_MODE") or ("cloud" if os.environ.get("SWANLAB_API_KEY") else "offline")
        swanlab.init(project=project, experiment_name=experiment, config={"FRAMEWORK": "meshrl", **config},
                     logdir=os.environ.get("SWANLAB_LOG_DIR") or str(run_dir / "swanlog"), mode=mode)

    def log(self, data: Mapping[str, float], step: int) -> None:
        self.swanlab.log(dict(data), step=step)

    def finish(self) -> None:
        self.swanlab.finish()


class _Trackio:
    def __init__(self, project: str, experiment: str, config: dict[str, Any]) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(project=project, name=experiment, config=config)

    def log(self, data: Mapping[str, float], step: int) -> None:
        self.trackio.log(dict(data), step=step)

    def finish(self) -> None:
        self.trackio.finish()


class Tracking:
    """The trackers of one run (verl's Tracking): `log(data, step)` goes to each; `finish()` closes
    them. `console` and `jsonl` are handled elsewhere and open nothing here."""

    def __init__(self, project: str, experiment: str, loggers: Iterable[str], *, config: dict[str, Any],
                 run_dir: Path) -> None:
        names = list(dict.fromkeys(loggers))
        check_loggers(names)
        self.backends: dict[str, Backend] = {}
        self._failing: set[str] = set()
        try:
            for name in names:
                if name == "tensorboard":
                    self.backends[name] = _Tensorboard(run_dir)
                elif name == "wandb":
                    self.backends[name] = _Wandb(project, experiment, config, run_dir)
                elif name == "mlflow":
                    self.backends[name] = _Mlflow(project, experiment, config, run_dir)
                elif name == "swanlab":
                    self.backends[name] = _Swanlab(project, experiment, config, run_dir)
                elif name == "trackio":
                    self.backends[name] = _Trackio(project, experiment, config)
        except BaseException:
            self.finish()
            raise

    def log(self, data: Mapping[str, float], step: int) -> None:
        """To every tracker. One that fails (its server down) is logged once per failure streak
        and does not stop the run: the metrics files keep every number."""
        if not data:
            return
        for name, backend in self.backends.items():
            try:
                backend.log(data, step)
                self._failing.discard(name)
            except Exception as exc:  # noqa: BLE001 -- a tracker outage must not end a training run
                if name not in self._failing:
                    log.warning("tracker_log_failed", logger=name, step=step, error=f"{type(exc).__name__}: {exc}")
                self._failing.add(name)

    def finish(self) -> None:
        backends, self.backends = self.backends, {}
        for name, backend in backends.items():
            try:
                backend.finish()
            except Exception as exc:  # noqa: BLE001 -- one tracker failing to close must not hide the others
                log.warning("tracker_finish_failed", logger=name, error=str(exc))


def numeric(rec: Mapping[str, Any], skip: frozenset[str] = _SKIP) -> dict[str, float]:
    return {k: float(v) for k, v in rec.items()
            if k not in skip and isinstance(v, int | float) and not isinstance(v, bool)}


class MetricsFollower:
    """Reads what the services append to <run_dir>/metrics/*.jsonl and logs every complete line
    once (a line still being written waits for the next `pump`)."""

    FILES = ("trainer", "validation", "rollout")

    def __init__(self, run_dir: Path, tracking: Tracking, *, from_end: bool = False) -> None:
        self.run_dir = run_dir
        self.tracking = tracking
        self.offsets = {name: 0 for name in self.FILES}
        self.step = 0
        if from_end:  # a resumed run: what is there was logged by the first session
            for name in self.FILES:
                path = self._path(name)
                self.offsets[name] = path.stat().st_size if path.exists() else 0
            # what follows is logged after the newest trainer step already logged, not at step 0
            self.offsets["trainer"], end = 0, self.offsets["trainer"]
            for rec in self._new_records("trainer"):
                if isinstance(rec.get("step"), int | float):
                    self.step = max(self.step, int(rec["step"]))
            self.offsets["trainer"] = end

    def _path(self, name: str) -> Path:
        return self.run_dir / "metrics" / f"{name}.jsonl"

    def _new_records(self, name: str) -> list[dict[str, Any]]:
        path = self._path(name)
        if not path.exists():
            return []
        with path.open("rb") as f:
            f.seek(self.offsets[name])
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self.offsets[name] += end
        out = []
        for line in chunk[:end].decode().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def pump(self) -> int:
        """Log what arrived since the last call, in the order it was recorded (each record's
        `time`), so that a validation lands at the trainer step it followed; returns the number
        of records logged."""
        new = [(float(rec.get("time", 0.0)), i, name, rec)
               for i, name in enumerate(self.FILES) for rec in self._new_records(name)]
        for _, _, name, rec in sorted(new, key=lambda x: (x[0], x[1])):
            if name == "trainer":
                self.step = max(self.step, int(rec.get("step", self.step)))
                data = numeric(rec)
            elif name == "validation":
                data = numeric(rec, _SKIP | {"policy_version"})
                data["val/policy_version"] = float(rec.get("policy_version", 0))
            else:
                data = numeric(rec)
            self.tracking.log(data, self.step)
        return len(new)


def start_tracking(cfg: Any, run_dir: Path, *, resumed: bool) -> MetricsFollower | None:
    """The trackers `cfg.trainer.logger` names, following the run's metrics; None when it names
    only console and jsonl."""
    t = cfg.trainer
    if not set(t.logger) - {"console", "jsonl"}:
        return None
    tracking = Tracking(t.project_name, t.experiment_name, t.logger, config=cfg.model_dump(mode="json"),
                        run_dir=run_dir)
    return MetricsFollower(run_dir, tracking, from_end=resumed)
