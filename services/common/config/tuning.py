"""`tuning.*`: process-level performance knobs that change no result, only who runs first."""

from __future__ import annotations

from pydantic import Field

from .base import ConfigModel


class NiceConfig(ConfigModel):
    """CPU niceness (-20..19) per kind of process, all its threads; null: leave it. Ray starts
    workers at 15 and its own daemons at 0. On a host whose cores the trainer's ranks share with
    the services, ranks at 0 and everything else at 19 keeps the services from preempting the
    training thread (services/common/priority.py). Lowering a value needs root, CAP_SYS_NICE or
    RLIMIT_NICE (`ulimit -e`); without, the process keeps Ray's and logs `niceness_not_permitted`."""

    trainer_ranks: int | None = Field(default=None, ge=-20, le=19)
    """The trainer's rank actors (was `trainer_service.worker_nice`)."""
    ray_daemons: int | None = Field(default=None, ge=-20, le=19)
    """A local Ray's own processes (GCS, dashboard, monitors, agents) and Serve's controller and
    proxy, set once Serve is up; not the raylet, whose workers would inherit it. Ignored when
    joining a cluster (`serve.ray_address`). (Was `serve.ray_nice`.)"""
    coordinator: int | None = Field(default=None, ge=-20, le=19)
    """The coordinator's replica (was `serve.coordinator.nice`)."""
    rollout: int | None = Field(default=None, ge=-20, le=19)
    """Each rollout replica (was `serve.rollout.nice`)."""
    reward: int | None = Field(default=None, ge=-20, le=19)
    """Each reward replica (was `serve.reward.nice`)."""
    param_server: int | None = Field(default=None, ge=-20, le=19)
    """The param server's replica (was `serve.param_server.nice`)."""
    trainer: int | None = Field(default=None, ge=-20, le=19)
    """The trainer's driver replica, not its ranks (was `serve.trainer.nice`)."""


class TuningConfig(ConfigModel):
    """Knobs that trade nothing but speed."""

    nice: NiceConfig = NiceConfig()
    """CPU niceness per kind of process."""
