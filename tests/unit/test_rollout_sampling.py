"""Top-k / top-p truncation of the transformers engine (services/rollout/engines/sampling.py): the
same token sets as vLLM and Hugging Face, which apply top-k first (every token tied with the k-th
kept) and take the nucleus of what it left, renormalised."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from services.rollout.engines.sampling import truncate_top_k_top_p


def _kept(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> list[list[int]]:
    out = truncate_top_k_top_p(scaled, torch.tensor(top_k), torch.tensor(top_p))
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in out]


def _hf_kept(row: torch.Tensor, k: int, p: float) -> list[int]:
    x = row[None].clone()
    if k > 0:
        x = TopKLogitsWarper(top_k=k)(None, x)
    if p < 1:
        x = TopPLogitsWarper(top_p=p)(None, x)
    return torch.isfinite(x[0]).nonzero().flatten().tolist()


def test_top_p_takes_the_nucleus_of_what_top_k_left() -> None:
    # probs 0.4, 0.35, 0.25; top_k=2 keeps {0, 1}, renormalised 0.53, 0.47; top_p=0.5 keeps {0}.
    # Over the full distribution the nucleus would be {0, 1} (0.4 < 0.5).
    scaled = torch.log(torch.tensor([[0.4, 0.35, 0.25]]))
    assert _kept(scaled, [2], [0.5]) == [[0]] == [_hf_kept(scaled[0], 2, 0.5)]


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    scaled = torch.log(torch.tensor([[0.4, 0.3, 0.3], [0.1, 0.3, 0.3]]))
    assert _kept(scaled, [2, 1], [1.0, 1.0]) == [[0, 1, 2], [1, 2]]
    assert [_hf_kept(scaled[0], 2, 1.0), _hf_kept(scaled[1], 1, 1.0)] == [[0, 1, 2], [1, 2]]


def test_token_sets_match_hugging_face_row_by_row_in_a_mixed_batch() -> None:
    g = torch.Generator().manual_seed(0)
    rows = 64
    scaled = torch.randn(rows, 50, generator=g) * 2
    top_k = [int(k) for k in torch.randint(-1, 20, (rows,), generator=g)]
    top_k = [k if k > 0 else -1 for k in top_k]
    top_p = [float(p) if i % 4 else 1.0 for i, p in enumerate(torch.rand(rows, generator=g) * 0.9 + 0.05)]
    kept = _kept(scaled, top_k, top_p)
    for i in range(rows):
        assert kept[i] == _hf_kept(scaled[i], top_k[i], top_p[i]), (i, top_k[i], top_p[i])


def test_a_row_without_truncation_keeps_its_whole_vocabulary_beside_one_with_top_p() -> None:
    # top_p = 1 is off: a float32 cumsum over a peaked distribution reaches 1.0 long before its
    # tail ends, which must not cut the tail of a row that asked for no truncation.
    g = torch.Generator().manual_seed(0)
    scaled = torch.randn(2, 50_000, generator=g) * 8
    kept = _kept(scaled, [-1, 5], [1.0, 0.5])
    assert len(kept[0]) == 50_000
    assert kept[1] == _hf_kept(scaled[1], 5, 0.5)


def test_a_tiny_temperature_samples_the_argmax_beside_a_normal_row() -> None:
    # logits / 1e-39 overflows float32 to +-inf, and log_softmax / softmax of such a row are NaN:
    # torch.multinomial raised in the scheduler thread, which failed every request in flight and
    # left the engine dead. A temperature this small is greedy in all but name.
    from services.rollout.engines.sampling import sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    temperature = torch.tensor([1e-39, 1e-45, 1.0])
    tokens, logprobs = sample(logits, temperature, torch.tensor([-1, 5, -1]), torch.tensor([1.0, 0.9, 1.0]),
                              [None, torch.Generator().manual_seed(1), None], g)
    assert tokens[:2].tolist() == [int(logits[0].argmax()), int(logits[1].argmax())]
    assert logprobs[:2].tolist() == [0.0, 0.0]
    assert logprobs[2] == pytest.approx(float(torch.log_softmax(logits[2], -1)[tokens[2]]), abs=1e-5)
