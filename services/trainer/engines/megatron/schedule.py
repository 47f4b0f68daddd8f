"""The LR schedule of `actor.optim` as a pure function of the step: the FSDP engine's
(`optim.lr_lambda`, warmup then constant / cosine / linear decay to `min_lr_ratio`) times the
peak LR, so the two engines and a checkpoint resume cannot drift apart."""

from __future__ import annotations

from services.common.config.actor_rollout_ref import OptimConfig
from services.trainer.engines.optim import lr_lambda


def lr_at(optim: OptimConfig, step: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based: the first step uses lr_at(0))."""
    return optim.lr * lr_lambda(optim, total_steps)(step)
