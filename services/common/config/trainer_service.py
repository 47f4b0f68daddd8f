"""`trainer_service.*`: the trainer service's own settings, and (`loop`) what its loop reads from
verl's sections, mapped here at load."""

from __future__ import annotations

from pydantic import Field

from .base import ConfigModel
from .trainer_loop import TrainerLoopConfig


class TrainerServiceConfig(ConfigModel):
    """The trainer service: one training group driven by one Serve replica."""

    trainer_id: str = "trainer-0"
    """Id the trainer presents to the coordinator (FetchBatch, CommitVersion, ...)."""
    coordinator_address: str | None = None
    """host:port of CoordinatorService; null: `coordinator.host:coordinator.port`."""
    coordinator_application: str | None = None
    """Serve application name when the coordinator sits behind Serve's gRPC ingress with other apps."""
    coordinator_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline of one coordinator call (FetchBatch adds its own wait)."""
    coordinator_wait_s: float = Field(default=600.0, ge=0)
    """How long the trainer's first call (ResumeTrainer) is retried while the coordinator is not
    up yet (the apps of one `serve deploy` start together); 0: fail at once."""
    fetch_timeout_ms: int = Field(default=5_000, ge=0, le=600_000)
    """How long one FetchBatch waits for groups before returning what is queued (the loop then
    fetches again; operator requests are checked between fetches)."""
    max_restarts: int = Field(default=1, ge=0)
    """Times `meshrl train` lets Serve restart a trainer replica whose loop failed (a rank died,
    an engine error): the new replica rebuilds its ranks and resumes from the newest checkpoint,
    and groups delivered after it are trained again. Past this, or 0, the run stops with the
    cause and prints `meshrl train --resume RUN_DIR`. (A `serve deploy` has no driver: Serve
    restarts the replica every time.)"""
    restart_timeout_s: float = Field(default=300.0, gt=0)
    """How long `meshrl train` waits for a restarted trainer replica to train again before it
    stops the run."""
    max_checkpoints_to_keep: int | None = Field(default=3, ge=1)
    """Newest checkpoints kept under the checkpoint directory; null: keep all."""
    publisher: str = "in_process"
    """Weight publisher: `param_server` (the param server, over the rollout group's transport
    `actor_rollout_ref.rollout.checkpoint_engine.backend`) or `in_process` (versions kept in the
    trainer's memory: tests and single-process use only, rollouts cannot fetch them)."""
    overlap: bool = False
    """While the group trains a step, commit the previous version's publish and fetch the next
    step's groups (FetchBatch train_version = the version they will train at); the export of a
    new version is ordered before the next step, whose training overlaps that version's publish.
    Staleness, the budget and the ledger are as without it. Pays when the trainer is the
    bottleneck (the built-in example on CPU); a rollout-bound run measured slower with it, cause
    not found, so it is off by default (BENCHMARKS.md, "e2e on CPU" and "e2e on 2 GPUs")."""
    worker_num_cpus: float = Field(default=1.0, ge=0)
    """CPUs reserved per training rank actor (placement group bundle)."""
    worker_resources: dict[str, float] = {}
    """Custom Ray resources per training rank (added to its bundle), e.g. {"node_c": 1} to keep the
    ranks on the nodes that carry that resource (`ray start --resources`); the trainer's own
    replica is placed by `serve.trainer.resources`."""
    hf_export_dir: str | None = "hf_export"
    """Where the final policy is exported as a Hugging Face checkpoint when the run ends, relative
    to the run directory; null: no export."""
    metrics_file: str = "metrics/trainer.jsonl"
    """Per-step metrics, relative to the run directory."""
    loop: TrainerLoopConfig = Field(default=TrainerLoopConfig(), exclude=True)
    """The loop's settings from verl's keys (trainer_loop.py): filled at load, not input, left
    out of dumps."""
