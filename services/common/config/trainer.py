"""`trainer.*` and top-level `rollout.*`: run length, resources and persistence (verl names)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import ConfigModel


class TrainerConfig(ConfigModel):
    """verl's `trainer` section."""

    project_name: str = "meshrl"
    """Project name: the tracker project (wandb/swanlab/trackio project, mlflow experiment)."""
    experiment_name: str = "default"
    """Experiment name: the tracker run's name and the run directory's prefix."""
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab", "trackio"]] = [
        "console", "jsonl"]
    """Metric sinks, verl's names: console (terminal progress), jsonl (metrics/*.jsonl, always
    written), tensorboard, wandb, mlflow, swanlab, trackio (each needs its extra, e.g.
    `pip install 'meshrl[wandb]'`; meshrl/trackers.py); a single name is taken as a list."""
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    """Accelerator for training; `auto` picks cuda, then npu, then cpu."""
    nnodes: int = Field(default=1, ge=1)
    """Training nodes."""
    n_gpus_per_node: int = Field(default=1, ge=1)
    """Training devices per node (ranks of the training group)."""
    total_epochs: int | None = Field(default=None, ge=1)
    """Passes over the prompt data (verl fully async caps the run at len(data) * trainer.total_epochs
    prompts): stands for `rollout.total_epochs` when that is not given, and must equal it when it
    is; null: `rollout.total_epochs`."""
    total_training_steps: int | None = Field(default=None, ge=1)
    """Cap on total_train_steps (policy versions, as verl fully async counts them); null: derived."""
    save_freq: int = -1
    """Checkpoint every N optimizer steps (-1: only at the end and on request)."""
    test_freq: int = -1
    """Validate every N policy versions (-1: never)."""
    val_before_train: bool = True
    """Validate the initial policy (when `test_freq` > 0), as verl does by default."""
    default_local_dir: str | None = None
    """Checkpoint directory; null: `<run_dir>/checkpoints`."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """Resume from the newest checkpoint (`auto`), never (`disable`), or from `resume_from_path`.
    `resume_path` goes back to the path once: restarts with the same path (Serve restarting a
    crashed replica) resume from the newest checkpoint trained since; an `auto` start forgets
    that, so a later `resume_path` start goes back again. A start that goes back (`resume_path`,
    `disable`) renames the checkpoints in checkpoint_dir past its step to
    `global_step_N.abandoned-<hex>`: kept, never resumed from or rotated."""
    resume_from_path: str | None = None
    """Checkpoint used with `resume_mode=resume_path`."""
    seed: int = 42
    """Seed for model init and training RNG."""

    @field_validator("logger", mode="before")
    @classmethod
    def _one_logger(cls, v: object) -> object:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        return self


class RolloutResourcesConfig(ConfigModel):
    """verl fully-async's top-level `rollout` section: rollout resources and run length."""

    nnodes: int = Field(default=1, ge=1)
    """Rollout nodes."""
    n_gpus_per_node: int = Field(default=1, ge=1)
    """Rollout devices per node."""
    total_rollout_steps: int = Field(default=100, ge=1)
    """Prompts to roll out over the run (verl counts prompts, not batches)."""
    total_epochs: int = Field(default=10, ge=1)
    """Upper bound on passes over the data (total = min(total_rollout_steps, len(data) * epochs);
    0 would roll out nothing)."""
    n: int | None = None
    """verl scripts set `rollout.n`; if given it must equal `actor_rollout_ref.rollout.n` or
    replaces it when that is left at its default."""

