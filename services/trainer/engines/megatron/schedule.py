"""The LR schedule of `actor.optim` as a pure function of the step (warmup, then constant /
cosine / linear decay to `min_lr_ratio`), so every engine and a checkpoint resume agree."""

from __future__ import annotations

import math

from services.common.config.actor_rollout_ref import OptimConfig


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    if optim.lr_warmup_steps >= 0:
        return optim.lr_warmup_steps
    return int(optim.lr_warmup_steps_ratio * total_steps)


def lr_at(optim: OptimConfig, step: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based: the first step uses lr_at(0))."""
    warm = warmup_steps(optim, total_steps)
    if warm > 0 and step < warm:
        return optim.lr * (step + 1) / warm
    if optim.lr_scheduler_type == "constant":
        return optim.lr
    floor = optim.lr * optim.min_lr_ratio
    span = max(1, total_steps - warm)
    progress = min(1.0, (step - warm) / span)
    if optim.lr_scheduler_type == "linear":
        return floor + (optim.lr - floor) * (1.0 - progress)
    cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * optim.num_cycles * progress))
    return floor + (optim.lr - floor) * cosine
