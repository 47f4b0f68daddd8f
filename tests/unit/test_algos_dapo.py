"""DAPO dynamic sampling: which groups carry signal."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.trainer.algos import dynamic_sampling_keep, dynamic_sampling_stats, dynamic_sampling_values
from tests.unit.algo_helpers import make_batch, mask_rows


def test_constant_groups_are_dropped_whole() -> None:
    # groups (interleaved on purpose): 10 all correct, 20 mixed, 30 all wrong, 40 singleton, 50 mixed floats
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.3, 1.0, 0.3, 0.30001])
    groups = torch.tensor([10, 10, 20, 20, 30, 30, 40, 10, 50, 50])
    keep = dynamic_sampling_keep(values, groups)
    assert keep.tolist() == [False, False, True, True, False, False, True, False, True, True]
    stats = dynamic_sampling_stats(keep, groups)
    assert stats == {
        "filter_groups/num_groups": 5.0,
        "filter_groups/kept_groups": 3.0,
        "filter_groups/filtered_groups": 2.0,
        "filter_groups/filtered_seqs": 5.0,
    }


def test_integer_and_bool_values_and_empty() -> None:
    assert dynamic_sampling_keep(torch.tensor([1, 1, 0, 1]), torch.tensor([0, 0, 1, 1])).tolist() == [False, False, True, True]
    assert dynamic_sampling_keep(torch.tensor([True, True]), torch.tensor([3, 3])).tolist() == [False, False]
    assert dynamic_sampling_keep(torch.zeros(0), torch.zeros(0, dtype=torch.int64)).tolist() == []


def test_bad_values_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="NaN"):
        dynamic_sampling_keep(torch.tensor([float("nan"), 1.0]), torch.tensor([0, 0]))
    with pytest.raises(InvalidArgument, match="shapes"):
        dynamic_sampling_keep(torch.tensor([1.0, 1.0]), torch.tensor([0]))


def test_metric_lookup() -> None:
    batch = make_batch(mask_rows([[0, 1], [0, 1]]), rewards=[1.0, 0.0], groups=[0, 0])
    batch.seq_tensors["acc"] = torch.tensor([1.0, 1.0])
    assert dynamic_sampling_values(batch.seq_tensors, "acc").tolist() == [1.0, 1.0]
    assert dynamic_sampling_values(batch.seq_tensors, "score").tolist() == [1.0, 0.0]  # verl name for the reward
    with pytest.raises(InvalidArgument, match=r"filter_groups\.metric"):
        dynamic_sampling_values(batch.seq_tensors, "pass_at_8")
