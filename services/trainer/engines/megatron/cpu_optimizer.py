"""The megatron engine's optimizer on CPU: megatron's optimizer is CUDA-only, so a torch
AdamW runs over megatron's fp32 main grads, with megatron's model-parallel grad-norm and clipping
rules. It answers the calls the engine makes of megatron's optimizer (`step`, `zero_grad`,
`param_groups`, `state_dict`, `load_state_dict`), so the engine has one code path."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


class CpuOptimizer:
    """AdamW over the chunks' trainable parameters, configured from megatron's OptimizerConfig
    (lr, betas, eps, weight_decay, clip_grad)."""

    def __init__(self, chunks: list[torch.nn.Module], config: Any) -> None:
        self.chunks = chunks
        self.clip_grad = float(config.clip_grad)
        params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        self._adamw = torch.optim.AdamW(
            params, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._adamw.param_groups

    def zero_grad(self) -> None:
        self._adamw.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self._adamw.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._adamw.load_state_dict(state)

    def step(self) -> tuple[bool, float, None]:
        """One update, unless the gradient norm is not finite; returns (updated, grad norm, None). The norm
        counts each parameter once across the model-parallel group (shared and TP-duplicated
        parameters once), dense and expert parameters over their own groups."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        dense_sq = torch.zeros((), dtype=torch.float64)
        expert_sq = torch.zeros((), dtype=torch.float64)
        params = []
        for chunk in self.chunks:
            for p in chunk.parameters():
                if not p.requires_grad:
                    continue
                grad = getattr(p, "main_grad", None)
                if grad is None:
                    continue
                p.grad = grad.to(p.dtype)
                params.append(p)
                if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                    sq = grad.double().pow(2).sum()
                    if getattr(p, "allreduce", True):
                        dense_sq += sq
                    else:
                        expert_sq += sq
        dist.all_reduce(dense_sq, group=ps.get_model_parallel_group())
        dist.all_reduce(expert_sq, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        grad_norm = float((dense_sq + expert_sq).sqrt())
        # A non-finite norm skips the update (as the engine's megatron path and the FSDP engine
        # do); clip_grad <= 0 turns clipping off, as in megatron (not a scale of 0).
        finite = math.isfinite(grad_norm)
        clip = self.clip_grad / (grad_norm + 1e-6) if finite and self.clip_grad > 0 else 1.0
        if clip < 1.0:
            for p in params:
                p.grad.mul_(clip)  # type: ignore[union-attr]
        if finite:
            self._adamw.step()
        for p in params:
            p.grad = None
        return finite, grad_norm, None
