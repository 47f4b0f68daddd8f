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
    """Mask (to -inf) the tokens outside each row's top-k and nucleus top-p set. `scaled`: [B, V]
    temperature-scaled logits; top_k: [B] int (<= 0 = off); top_p: [B] float (1 = off)."""
    if not bool((top_k > 0).any()) and not bool((top_p < 1).any()):
        return scaled
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=scaled.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
    drop = ranks >= k
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass of strictly better tokens already reaches top_p (the best token
    # always survives).
    before = torch.cumsum(probs, dim=-1) - probs
    drop |= before >= top_p.unsqueeze(-1)
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
    scaled = logits / safe_t
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
