"""AdamW and the learning-rate schedule.

The schedule is a pure function of the optimizer step s (0-based: the LR used by step s):

    warmup  (s < W):  lr * (s + 1) / W                 first step already trains (never lr 0)
    after:            constant  lr
                      cosine    lr * (m + (1 - m) * 0.5 * (1 + cos(2 pi c p)))
                      linear    lr * (m + (1 - m) * (1 - p))
    with p = (s - W) / max(1, T - W) clipped to [0, 1], m = min_lr_ratio, c = num_cycles,
    T = total optimizer steps, W = lr_warmup_steps (or int(lr_warmup_steps_ratio * T)).

T must be known before the optimizer is built whenever the schedule depends on it (decay or a
warmup ratio); a missing T is a config error, never a silent LR of 0 (a verl pitfall).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from services.common.config.actor_rollout_ref import OptimConfig
from services.common.errors import ConfigError


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    if optim.lr_warmup_steps >= 0:
        return optim.lr_warmup_steps
    return int(optim.lr_warmup_steps_ratio * max(0, total_steps))


def lr_lambda(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of `optim.lr` for optimizer step s (see module docstring)."""
    needs_total = optim.lr_scheduler_type != "constant" or (optim.lr_warmup_steps < 0 and optim.lr_warmup_steps_ratio > 0)
    if needs_total and total_steps <= 0:
        raise ConfigError(
            f"actor_rollout_ref.actor.optim: lr_scheduler_type={optim.lr_scheduler_type!r} with "
            f"lr_warmup_steps_ratio={optim.lr_warmup_steps_ratio} needs the total optimizer step count before the "
            "optimizer is built; set actor_rollout_ref.actor.optim.total_training_steps or a finite "
            "rollout.total_rollout_steps"
        )
    warm = warmup_steps(optim, total_steps)
    if needs_total and warm >= total_steps > 0 and optim.lr_scheduler_type != "constant":
        raise ConfigError(
            f"actor_rollout_ref.actor.optim: warmup ({warm} steps) covers the whole run ({total_steps} steps); "
            "lower lr_warmup_steps / lr_warmup_steps_ratio"
        )
    floor, cycles, kind = optim.min_lr_ratio, optim.num_cycles, optim.lr_scheduler_type

    def multiplier(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if kind == "constant":
            return 1.0
        progress = min(1.0, max(0.0, (step - warm) / max(1, total_steps - warm)))
        if kind == "cosine":
            return floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * 2.0 * cycles * progress))
        return floor + (1 - floor) * (1.0 - progress)

    return multiplier


def build_optimizer(
    params: Iterable[torch.nn.Parameter], optim: OptimConfig, total_steps: int, device: str = "cpu"
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its LambdaLR schedule (the schedule is validated first). The fused kernel on CPU
    and CUDA, the multi-tensor one elsewhere: with sharded (DTensor) parameters torch's default
    falls back to a per-parameter loop, 4-8x slower."""
    multiplier = lr_lambda(optim, total_steps)
    impl = {"fused": True} if device in ("cpu", "cuda") else {"foreach": True}
    opt = torch.optim.AdamW(
        list(params), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay, **impl
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, multiplier)
