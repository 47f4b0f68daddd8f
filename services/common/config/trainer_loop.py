"""`trainer_service.loop`: the trainer loop's settings, one section the trainer service reads.

The values live in verl's sections (`actor_rollout_ref.actor.ppo_epochs`, `trainer.save_freq`,
`async_training.require_batches`, `algorithm.filter_groups.*` ...), and that layout stays the
input format: resolve.py (`LOOP_KEYS`) copies each key named below into this section before
validation. The section is derived, not input: setting `trainer_service.loop.*` is an error that
names the verl key to set instead, and it is left out of dumps (`config.resolved.yaml`, a Serve
application's args), so a dumped config that is edited and loaded again is derived afresh.
Like every value resolve.py fills, it is fixed when the tree is validated: assigning a verl key
of a loaded config in place does not change it (build a new config instead).
"""

from __future__ import annotations

from typing import Literal

from .base import ConfigModel


def run_length(
    *, required: int, trigger: int, total_rollout_steps: int, total_epochs: int, total_training_steps: int | None,
    dataset_size: int | None,
) -> tuple[int, int]:
    """(prompts rolled out, weight versions published) over the run, verl fully async's count:
    `dataset_size` (when known) caps the prompts at dataset_size * total_epochs; versions are
    prompts / (required * trigger), capped by total_training_steps."""
    total = total_rollout_steps if dataset_size is None else min(total_rollout_steps, dataset_size * total_epochs)
    versions = int(total / (required * trigger))
    if total_training_steps is not None:
        # verl's fully async counts trainer.total_training_steps like total_train_steps.
        versions = min(versions, total_training_steps)
    return total, versions


class TrainerLoopConfig(ConfigModel):
    """What the trainer loop reads, each field filled from the verl key its docstring names.
    The defaults equal those keys' defaults (a test checks); field types repeat theirs, with no
    bounds of their own: the verl key's section checks the value."""

    ppo_mini_batch_size: int = 256
    """From actor_rollout_ref.actor.ppo_mini_batch_size: prompt groups per mini-batch."""
    require_batches: int = 1
    """From async_training.require_batches: mini-batches per trainer step."""
    trigger_parameter_sync_step: int = 4
    """From async_training.trigger_parameter_sync_step (after `mode=sync` fills it): trainer steps
    between weight publications."""
    ppo_epochs: int = 1
    """From actor_rollout_ref.actor.ppo_epochs: passes over each mini-batch."""
    shuffle: bool = False
    """From actor_rollout_ref.actor.shuffle: shuffle sequences across micro-batches."""
    use_kl_loss: bool = False
    """From actor_rollout_ref.actor.use_kl_loss: add a KL(policy || reference) loss term."""
    temperature: float = 1.0
    """From actor_rollout_ref.rollout.temperature: the sampling temperature the log-probs are
    recomputed at."""
    update_weights_bucket_megabytes: int = 2048
    """From actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes: size of
    one published weight bucket (MiB)."""
    total_rollout_steps: int = 100
    """From rollout.total_rollout_steps: prompts rolled out over the run."""
    total_epochs: int = 10
    """From rollout.total_epochs: cap on passes over the data."""
    total_training_steps: int | None = None
    """From trainer.total_training_steps: cap on weight versions; null: derived."""
    save_freq: int = -1
    """From trainer.save_freq: checkpoint every N trainer steps (-1: at the end and on request)."""
    default_local_dir: str | None = None
    """From trainer.default_local_dir: checkpoint directory; null: `<run_dir>/checkpoints`."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """From trainer.resume_mode: resume from the newest checkpoint, never, or resume_from_path."""
    resume_from_path: str | None = None
    """From trainer.resume_from_path: the checkpoint of `resume_mode=resume_path`."""
    seed: int = 42
    """From trainer.seed: seed of the training RNG."""
    bypass_mode: bool = True
    """From algorithm.rollout_correction.bypass_mode: true, old log-probs = rollout log-probs;
    false, recomputed with the parameters at the start of the sync window (decoupled PPO)."""
    filter_metric: str = "acc"
    """From algorithm.filter_groups.metric: metric compared across a group's responses."""
    max_num_gen_batches: int = 0
    """From algorithm.filter_groups.max_num_gen_batches: give up after this many extra fetches
    per step (0: no limit)."""

    @property
    def groups_per_step(self) -> int:
        """Prompt groups a trainer step takes: required_samples = ppo_mini_batch_size * require_batches."""
        return self.ppo_mini_batch_size * self.require_batches

    def total_local_steps(self, dataset_size: int | None) -> int:
        """Trainer steps of the run (weight versions x trigger_parameter_sync_step). It needs the
        dataset's size, known only once the data is read, so it is computed at run time."""
        _, versions = run_length(
            required=self.groups_per_step, trigger=self.trigger_parameter_sync_step,
            total_rollout_steps=self.total_rollout_steps, total_epochs=self.total_epochs,
            total_training_steps=self.total_training_steps, dataset_size=dataset_size,
        )
        return versions * self.trigger_parameter_sync_step
