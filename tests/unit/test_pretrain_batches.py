"""The warm start's SFT step runs a batch of mixed lengths as at most two passes of like-length
rows (meshrl/pretrain.py): the same gradient as one padded pass, fewer tokens."""

from __future__ import annotations

import random

import torch

from meshrl.pretrain import _like_lengths, _sft_backward, tool_add_trace
from services.common.tiny import build_tiny_model, build_tokenizer


def _mixed_batch(tok: object, n: int = 16) -> list[tuple[list[int], list[int], bool]]:
    rng = random.Random(3)
    out = []
    for i in range(n):
        ids, mask = tool_add_trace(tok, rng.randrange(100, 1000), rng.randrange(100, 1000), use_tool=i % 3 == 0)
        out.append((ids, mask, True))
    return out


def _grads(model: torch.nn.Module, batch: list[tuple[list[int], list[int], bool]], pad: int,
           split: bool) -> tuple[list[torch.Tensor], float, float | None]:
    model.zero_grad()
    loss, watched = _sft_backward(model, batch, pad, "cpu", split=split)
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], loss, watched


def test_a_mixed_batch_is_split_by_length_and_keeps_every_row() -> None:
    tok = build_tokenizer(tools=True)
    batch = _mixed_batch(tok)
    parts = _like_lengths(batch)
    assert len(parts) == 2
    assert sorted(map(id, batch)) == sorted(id(e) for part in parts for e in part)
    assert max(len(e[0]) for e in parts[0]) <= min(len(e[0]) for e in parts[1])
    padded_once = len(batch) * max(len(e[0]) for e in batch)
    padded_split = sum(len(p) * max(len(e[0]) for e in p) for p in parts)
    assert padded_split < 0.75 * padded_once
    # rows of one length stay one pass
    same = [batch[1]] * 8
    assert _like_lengths(same) == [same]


def test_the_split_passes_give_the_gradient_of_one_padded_pass() -> None:
    tok = build_tokenizer(tools=True)
    torch.manual_seed(0)
    model = build_tiny_model("qwen3", tok, seed=0).double()
    batch = _mixed_batch(tok)
    batch[0] = (batch[0][0], batch[0][1], False)  # one row stop_loss does not read
    whole, loss_whole, watched_whole = _grads(model, batch, tok.pad_token_id, split=False)
    split, loss_split, watched_split = _grads(model, batch, tok.pad_token_id, split=True)
    assert len(whole) == len(split) > 0 and any(g.abs().sum() > 0 for g in split)
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert abs(loss_whole - loss_split) < 1e-9
    assert watched_whole is not None and watched_split is not None and abs(watched_whole - watched_split) < 1e-9
    assert abs(watched_whole - loss_whole) > 1e-6  # the row left out changes the watched mean
