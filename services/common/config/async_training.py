"""`async_training.*`: the staleness budget and partial rollout (verl fully_async names)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import ConfigModel

MAX_STALENESS_THRESHOLD = 1000.0
"""Largest async_training.staleness_threshold (config and SetStaleness): a rollout 1000 sync windows
ahead is far past any useful setting, and the bound keeps the budget arithmetic finite."""


class AsyncTrainingConfig(ConfigModel):
    """How far rollout may run ahead of training.

    required_samples     = ppo_mini_batch_size * require_batches
    max_required_samples = int(required_samples * (1 + staleness_threshold) * trigger_parameter_sync_step)
    Leases are granted while the budget used since the last version commit is below
    max_required_samples; at each commit the budget restarts at in-flight + queued prompts.
    """

    mode: Literal["fully_async", "one_step_off", "sync"] = "fully_async"
    """`fully_async`: the staleness budget above. `one_step_off`: a whole batch generated with
    the previous weights (staleness 1, trigger 1, no partial rollout, max_staleness_versions 1).
    `sync`: lock-step (staleness 0, trigger 1), for A/B comparisons. A mode's keys are filled in
    when unset; a given one that contradicts the mode is an error (resolve.py)."""
    staleness_threshold: float = Field(default=0.1, ge=0, le=MAX_STALENESS_THRESHOLD, allow_inf_nan=False)
    """Extra fraction of a sync window that may be generated ahead (s); 0 with trigger 1 is on-policy."""
    trigger_parameter_sync_step: int = Field(default=4, ge=1)
    """Optimizer steps between weight publications (K)."""
    require_batches: int = Field(default=1, ge=1)
    """Mini-batches per optimizer step."""
    partial_rollout: bool = True
    """Let in-flight samples continue across a weight update (tokens tagged per version)."""
    partial_rollout_mode: Literal["keep", "abort"] = "abort"
    """`keep`: continue in-flight sequences on the new weights (KV kept). `abort`: resubmit
    prompt + tokens so far with max_tokens reduced (re-prefill with the new weights)."""
    max_resubmits: int = Field(default=64, ge=1)
    """With `abort`: how many times one generation cut by weight updates is continued (single-turn
    sample, agent-loop turn, gateway call) before it fails: its group goes back to the queue, the
    gateway answers the agent's call 503 `resubmit_limit`. Raise it when updates come faster than
    long generations finish."""
    concurrent_samples_per_replica: int = Field(default=16, ge=1)
    """Prompt groups in flight per rollout replica."""
    max_staleness_versions: int | None = Field(default=None, ge=0)
    """Hard bound (AReaL's eta): groups whose oldest token is more than this many versions
    behind are re-generated, never trained on. Null: only the budget applies."""
    use_trainer_do_validate: bool = False
    """verl knob; validation runs on the rollout replicas in meshrl (must be false)."""

    @field_validator("use_trainer_do_validate")
    @classmethod
    def _no_trainer_validate(cls, value: bool) -> bool:
        if value:
            raise ValueError("validation runs on rollout replicas in meshrl; set async_training.use_trainer_do_validate=false")
        return value
