"""Per-token logprobs and entropy from vocab-parallel logits (each TP rank holds a slice of the
vocabulary), differentiable, with megatron's padded vocabulary entries masked out so the
numbers equal a plain softmax over the real vocabulary.

Autograd: partial sums are combined with megatron's `reduce_from_tensor_model_parallel_region`
(all-reduce forward, identity backward), which is right because every TP rank then computes the
same loss from the combined values.
"""

from __future__ import annotations

import torch


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    tp_group: torch.distributed.ProcessGroup | None = None,
    tp_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [..., V_local] (this rank's vocabulary slice starting at `vocab_start`), targets
    [...] global ids. Returns (log p(target), entropy or None), both [...], float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    v_local = logits.shape[-1]
    real = vocab_size - vocab_start
    pad_mask = None
    if real < v_local:  # megatron's padded vocabulary entries on this rank: probability 0
        pad_mask = torch.arange(v_local, device=logits.device) >= max(real, 0)

    def allreduce_sum(t: torch.Tensor) -> torch.Tensor:
        if tp_size == 1:
            return t
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(t, group=tp_group)  # type: ignore[no-any-return]

    with torch.no_grad():
        real_logits = logits if pad_mask is None else logits.masked_fill(pad_mask, float("-inf"))
        local_max = real_logits.max(dim=-1).values
        if tp_size > 1:
            torch.distributed.all_reduce(local_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp()
    if pad_mask is not None:
        exp = exp.masked_fill(pad_mask, 0.0)
    sum_exp = allreduce_sum(exp.sum(dim=-1))
    lse = sum_exp.log()

    local_t = targets - vocab_start
    in_range = (local_t >= 0) & (local_t < v_local)
    picked = shifted.gather(-1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(in_range, picked, torch.zeros_like(picked))
    logprob = allreduce_sum(picked) - lse

    entropy = None
    if with_entropy:
        # H = lse - sum_v p_v * shifted_v (shifted logits; padded entries have p = 0).
        p_shift = (exp * shifted).sum(dim=-1)
        entropy = lse - allreduce_sum(p_shift) / sum_exp
    return logprob, entropy
