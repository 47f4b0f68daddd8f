"""trainer.logger: each tracker through its real library in its offline / local mode, fed by the
driver's MetricsFollower from a run directory's metrics files, then READ BACK from what the
library wrote (its own file format or store) and compared with what the run recorded."""

from __future__ import annotations

import glob
import json
import time
from pathlib import Path
from typing import Any

import pytest

from meshrl.trackers import INSTALL, MetricsFollower, MissingTracker, Tracking, check_loggers, mlflow_key
from tests.report_fixtures import make_run_dir
from tests.tracker_readers import wandb_history

pytestmark = pytest.mark.integration

STEPS = 6
REWARD = "critic/rewards/mean"
VAL = "val-core/openai/gsm8k/acc/mean@1"


def expected(run_dir: Path) -> tuple[dict[int, float], float]:
    steps = [json.loads(line) for line in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    vals = [json.loads(line) for line in (run_dir / "metrics" / "validation.jsonl").read_text().splitlines()]
    return {int(r["step"]): r[REWARD] for r in steps}, vals[-1][VAL]


def read_back(name: str, run_dir: Path, backend: Any) -> tuple[dict[int, float], list[float]]:
    """(reward by step, every logged value of the validation key) as the tracker stored them."""
    if name == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run_dir / "tensorboard"))
        acc.Reload()
        return {e.step: e.value for e in acc.Scalars(REWARD)}, [e.value for e in acc.Scalars(VAL)]
    if name == "wandb":
        # wandb's service process writes the .wandb file; under load its last records may land a
        # moment after run.finish() returned
        for _ in range(50):
            hist = wandb_history(run_dir)
            if any(REWARD in h for h in hist):
                break
            time.sleep(0.2)
        return ({int(h["_step"]): h[REWARD] for h in hist if REWARD in h}, [h[VAL] for h in hist if VAL in h])
    if name == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
        run_id = backend.run.info.run_id
        assert client.get_run(run_id).data.params["trainer/project_name"] == "proj"
        return ({m.step: m.value for m in client.get_metric_history(run_id, mlflow_key(REWARD))},
                [m.value for m in client.get_metric_history(run_id, mlflow_key(VAL))])
    if name == "swanlab":
        from swanlab.proto.swanlab.record.v1 import record_pb2
        from swanlab.sdk.internal.core_python.store import DataStoreReader

        (path,) = glob.glob(str(run_dir / "swanlog" / "run-*" / "*.swanlab"))
        reader = DataStoreReader()
        reader.open(path)
        scalars = []
        for raw in reader:
            rec = record_pb2.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "scalar":
                scalars.append((rec.scalar.key, rec.scalar.step, rec.scalar.value.number))
        reader.close()
        return {s: v for k, s, v in scalars if k == REWARD}, [v for k, _, v in scalars if k == VAL]
    if name == "trackio":
        from trackio.sqlite_storage import SQLiteStorage

        logs = SQLiteStorage.get_logs("proj", run="exp")
        return {int(r["step"]): r[REWARD] for r in logs if REWARD in r}, [r[VAL] for r in logs if VAL in r]
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow", "swanlab", "trackio"])
def test_tracker_holds_what_the_run_recorded(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MLFLOW_TRACKING_URI", "TENSORBOARD_DIR", "WANDB_DIR", "SWANLAB_LOG_DIR", "SWANLAB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network here: each library's own offline mode
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab-home"))
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    run_dir = make_run_dir(tmp_path / "run", steps=STEPS)
    config = {"trainer": {"project_name": "proj", "experiment_name": "exp", "logger": [name]},
              "actor_rollout_ref": {"model": {"path": "m"}}}
    tracking = Tracking("proj", "exp", ["console", "jsonl", name], config=config, run_dir=run_dir)
    assert list(tracking.backends) == [name]
    backend = tracking.backends[name]
    follower = MetricsFollower(run_dir, tracking)
    logged = follower.pump()
    assert logged == STEPS + 3 + 10  # trainer steps, validations, rollout samples
    assert follower.pump() == 0  # nothing is logged twice
    tracking.finish()
    rewards, val = expected(run_dir)
    got_rewards, got_val = read_back(name, run_dir, backend)
    assert got_rewards.keys() == rewards.keys()
    assert got_rewards == pytest.approx(rewards, rel=1e-6)
    assert got_val and got_val[-1] == pytest.approx(val, rel=1e-6)


def test_unknown_logger_and_missing_package_fail_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown logger 'neptune'; choose from console, jsonl"):
        check_loggers(["console", "neptune"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(MissingTracker, match=r"'wandb' package is not installed: pip install 'meshrl\[wandb\]'"):
        check_loggers(["jsonl", "wandb"])
    assert "--no-deps swanlab" in INSTALL["swanlab"][1]


def test_the_config_takes_verl_names_and_rejects_others() -> None:
    from services.common.config import load_config

    cfg = load_config(None, ["trainer.logger=[console,wandb,mlflow,swanlab,trackio,tensorboard,jsonl]"])
    assert cfg.trainer.logger[1] == "wandb"
    assert load_config(None, ["trainer.logger=console"]).trainer.logger == ["console"]
    with pytest.raises(Exception, match=r"trainer\.logger"):
        load_config(None, ["trainer.logger=[neptune]"])


def test_a_failing_tracker_does_not_stop_the_others(tmp_path: Path) -> None:
    class Down:
        def log(self, data: Any, step: int) -> None:
            raise ConnectionError("tracking server unreachable")

        def finish(self) -> None:
            pass

    class Kept:
        def __init__(self) -> None:
            self.steps: list[int] = []

        def log(self, data: Any, step: int) -> None:
            self.steps.append(step)

        def finish(self) -> None:
            pass

    tracking = Tracking("p", "e", ["console"], config={}, run_dir=tmp_path)
    kept = Kept()
    tracking.backends = {"down": Down(), "kept": kept}
    follower = MetricsFollower(make_run_dir(tmp_path / "run", steps=3), tracking)
    assert follower.pump() == 3 + 3 + 10
    assert kept.steps[-1] == 3
