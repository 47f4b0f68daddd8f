"""DAPO dynamic sampling (arXiv 2503.14476; verl `algorithm.filter_groups`): a group whose
responses all score the same has zero group-relative advantage and carries no gradient signal, so
the trainer drops it and fetches more groups until the batch is full.

The functions here only decide; the trainer drops the sequences, counts the dropped groups
(`dynamic_sampling_stats`), and asks the coordinator for more (at most
`algorithm.filter_groups.max_num_gen_batches` extra fetches per step, 0 = unbounded).

Like verl, a group with a single sequence is kept (verl: `std > 0 or len == 1`). "All equal" is
exact equality (verl tests std > 0, which is the same thing for finite values).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from services.common.errors import InvalidArgument

_REWARD_ALIASES = ("score", "seq_reward", "seq_final_reward")


def dynamic_sampling_keep(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """bool [B], per sequence: True where the sequence's group has non-constant `values` (or is a
    singleton). `values` and `group_index` are [B]; sequences of one prompt share a group index.
    Whole groups are kept or dropped together, so `batch.select(keep.nonzero())` keeps groups whole."""
    if values.shape != group_index.shape or values.dim() != 1:
        raise InvalidArgument("dynamic_sampling_keep", f"values {tuple(values.shape)} and group_index {tuple(group_index.shape)} must be equal 1-D shapes")
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=values.device)
    vals = values.to(torch.float64)
    if not torch.isfinite(vals).all():
        raise InvalidArgument("algorithm.filter_groups.metric", "values contain NaN or inf; fix the reward/metric")
    _, inv = torch.unique(group_index, return_inverse=True)
    num_groups = int(inv.max().item()) + 1
    gmax = torch.full((num_groups,), float("-inf"), dtype=vals.dtype, device=vals.device).scatter_reduce(0, inv, vals, "amax")
    gmin = torch.full((num_groups,), float("inf"), dtype=vals.dtype, device=vals.device).scatter_reduce(0, inv, vals, "amin")
    count = torch.bincount(inv, minlength=num_groups)
    keep_group = (gmax != gmin) | (count == 1)
    return keep_group[inv]


def dynamic_sampling_values(seq_tensors: Mapping[str, torch.Tensor], metric: str) -> torch.Tensor:
    """The [B] values `algorithm.filter_groups.metric` names among a batch's per-sequence tensors
    (SequenceBatch.seq_tensors, or trainer.convert.sequence_tensors of fetched groups): that
    tensor, or the reward for verl's `score` / `seq_reward` / `seq_final_reward` when no such
    tensor exists."""
    if metric in seq_tensors:
        return seq_tensors[metric]
    if metric in _REWARD_ALIASES and "reward" in seq_tensors:
        return seq_tensors["reward"]
    raise InvalidArgument(
        "algorithm.filter_groups.metric",
        f"{metric!r} is not a per-sequence tensor of the batch (present: {sorted(seq_tensors)})",
    )


def dynamic_sampling_stats(keep: torch.Tensor, group_index: torch.Tensor) -> dict[str, float]:
    """Group counts behind a `dynamic_sampling_keep` mask: filter_groups/{num_groups, kept_groups,
    filtered_groups, filtered_seqs}."""
    if keep.numel() == 0:
        return {"filter_groups/num_groups": 0.0, "filter_groups/kept_groups": 0.0,
                "filter_groups/filtered_groups": 0.0, "filter_groups/filtered_seqs": 0.0}
    groups, inv = torch.unique(group_index, return_inverse=True)
    kept = torch.zeros(groups.numel(), dtype=torch.bool, device=keep.device).scatter_(0, inv, keep)
    n, k = groups.numel(), int(kept.sum().item())
    return {
        "filter_groups/num_groups": float(n),
        "filter_groups/kept_groups": float(k),
        "filter_groups/filtered_groups": float(n - k),
        "filter_groups/filtered_seqs": float((~keep).sum().item()),
    }
