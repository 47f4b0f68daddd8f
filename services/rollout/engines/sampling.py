"""Token sampling shared by the transformers engine and the conformance tests.

`sample` draws one token per row and returns the logprob the trainer will recompute:
log_softmax(logits / temperature) at the drawn token, before top-k / top-p truncation (the
truncation only shapes the distribution that is sampled from). Greedy rows (temperature 0) take the
argmax and report log_softmax(logits) (temperature 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def truncate_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what vLLM's apply_top_k_top_p and Hugging Face's TopK -> TopP warpers mask:
    top-k first, keeping every token whose logit reaches the k-th largest (ties included), then
    top-p over what top-k left, renormalised. `scaled`: [B, V] temperature-scaled logits; top_k:
    [B] int (<= 0 = off); top_p: [B] float (1 = off)."""
    if not bool((top_k > 0).any()) and not bool((top_p < 1).any()):
        return scaled
    # Ascending, as vLLM and Hugging Face sort (stable: a tie at the top-p edge leaves by index,
    # lowest first), so the cumsum adds the tail first and cannot round up to 1 before the head.
    sorted_logits, order = torch.sort(scaled, dim=-1, stable=True)
    vocab = scaled.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(-1, (vocab - k).unsqueeze(-1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # Drop a token when the mass of tokens no more likely than it stays within 1 - top_p (with
    # top_p = 1 only tokens of probability 0); the most likely token always survives.
    mass = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    drop = mass <= 1 - top_p.unsqueeze(-1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    out = torch.empty_like(scaled)
    out.scatter_(-1, order, sorted_logits)
    return out


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. Returns (tokens [B] int64, logprobs [B] float32)."""
    logits = logits.float()
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    # Shifted by the row's max first (log_softmax and softmax do not change): a tiny temperature
    # (1e-39) divided raw logits to +-inf, a NaN distribution that made torch.multinomial raise in
    # the scheduler thread and fail every request in flight. Shifted, the top logit stays 0 and
    # the rest fall to -inf at worst: such a row samples its argmax.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / safe_t
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(truncate_top_k_top_p(scaled, top_k, top_p), dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    shared = [i for i, g in enumerate(generators) if g is None and not bool(greedy[i])]
    if shared:
        idx = torch.tensor(shared, device=logits.device)
        tokens[idx] = torch.multinomial(probs[idx], 1, generator=default_generator).squeeze(-1)
    for i, g in enumerate(generators):
        if bool(greedy[i]):
            tokens[i] = torch.argmax(logits[i])
        elif g is not None:
            # A per-sample generator keeps a seeded sample's draws independent of its batch mates.
            # Drawn on the generator's device (CPU) so seeds reproduce across devices.
            tokens[i] = torch.multinomial(probs[i].to(g.device), 1, generator=g).to(logits.device).squeeze(-1)
    chosen = logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen
