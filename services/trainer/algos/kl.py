"""Per-token KL estimators between the policy and a reference (verl `kl_penalty`).

With r = log pi - log pi_ref on tokens sampled from pi (http://joschu.net/blog/kl-approx.html):
- `kl` / `k1`:          r                              (unbiased for KL(pi||ref), high variance)
- `abs`:                |r|
- `mse` / `k2`:         r^2 / 2                        (biased; its gradient is the KL's)
- `low_var_kl` / `k3`:  exp(-r) + r - 1, clamped to [-10, 10], r clamped to [-20, 20]  (unbiased, >= 0)
A `+` suffix (`k3+`, `low_var_kl+`, `k1+`, ...) keeps the estimator's value but the gradient of k2,
straight-through, so the KL gradient is unbiased (verl's `+` variants).
"""

from __future__ import annotations

import torch

from services.common.errors import InvalidArgument

KL_TYPES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def _forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_type: str) -> torch.Tensor:
    if kl_type in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_type == "abs":
        return (logprob - ref_logprob).abs()
    if kl_type in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_type in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)
    raise InvalidArgument("kl type", f"unknown KL estimator {kl_type!r}; choose from {KL_TYPES} (optionally with '+')")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """[B, L] per-token KL estimate of the policy against the reference (see the module docstring)."""
    base = kl_type[:-1] if kl_type.endswith("+") else kl_type
    value = _forward(logprob, ref_logprob, base)
    if not kl_type.endswith("+") or base in ("mse", "k2"):
        return value
    grad_carrier = 0.5 * (logprob - ref_logprob).square()
    return grad_carrier - grad_carrier.detach() + value.detach()
