"""Shaping stages: applied to every Score after its scorer (built-in, custom or remote), in order.

A stage is any object with `apply(sample, score) -> Score`. The one built in is DAPO's overlong
buffer (verl `DAPORewardManager`): with L the response length in tokens, M the response cap and B
the buffer length,

    penalty = min(-(L - (M - B)) / B * penalty_factor, 0)

is added to the score: 0 up to M - B tokens, falling linearly to -penalty_factor at M. With `log`
the metrics `overlong_reward` (the penalty) and `overlong` (1 if penalised) are reported.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from .samples import Sample, Score


class Stage(Protocol):
    """A shaping stage."""

    name: str

    def apply(self, sample: Sample, score: Score) -> Score: ...


def overlong_penalty(length: int, max_length: int, buffer_len: int, penalty_factor: float) -> float:
    """verl DAPO's overlong reward: <= 0, linear in the last `buffer_len` tokens before `max_length`."""
    assert buffer_len > 0
    expected = max_length - buffer_len
    return min(-(length - expected) / buffer_len * penalty_factor, 0.0)


class OverlongShaping:
    """DAPO overlong buffer (reward_model.overlong_buffer). The cap is the item's
    max_response_length, or `default_max_length` (data.max_response_length) when the item has 0."""

    name = "overlong_buffer"

    def __init__(self, *, buffer_len: int, penalty_factor: float, default_max_length: int, log: bool) -> None:
        assert buffer_len > 0 and default_max_length >= buffer_len
        self.buffer_len = buffer_len
        self.penalty_factor = penalty_factor
        self.default_max_length = default_max_length
        self.log = log

    def max_length(self, sample: Sample) -> int:
        return sample.max_response_length or self.default_max_length

    def apply(self, sample: Sample, score: Score) -> Score:
        penalty = overlong_penalty(sample.response_length, self.max_length(sample), self.buffer_len, self.penalty_factor)
        metrics = dict(score.metrics)
        if self.log:
            metrics["overlong_reward"] = penalty
            metrics["overlong"] = float(penalty < 0)
        return replace(score, score=score.score + penalty, metrics=metrics)
