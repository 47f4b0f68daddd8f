"""Small builders for the algos unit tests (hand-written, no mocks)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from services.trainer.engines.base import SequenceBatch


def mask_rows(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def make_batch(
    response_mask: torch.Tensor,
    rewards: Sequence[float] | None = None,
    groups: Sequence[int] | None = None,
    **tensors: torch.Tensor,
) -> SequenceBatch:
    """A batch with the given [B, L] response mask; prompt tokens wherever the mask is 0."""
    b, length = response_mask.shape
    seq: dict[str, torch.Tensor] = {}
    if rewards is not None:
        seq["reward"] = torch.tensor(rewards, dtype=torch.float32)
    if groups is not None:
        seq["group_index"] = torch.tensor(groups, dtype=torch.int64)
    return SequenceBatch(
        input_ids=torch.ones(b, length, dtype=torch.int64),
        attention_mask=torch.ones(b, length, dtype=torch.int64),
        response_mask=response_mask.clone(),
        tensors=dict(tensors),
        seq_tensors=seq,
    )


def logs(values: Sequence[Sequence[float]]) -> torch.Tensor:
    """Elementwise natural log of a nested list of probabilities (0 stays 0: padding)."""
    return torch.tensor([[math.log(v) if v > 0 else 0.0 for v in row] for row in values], dtype=torch.float32)
