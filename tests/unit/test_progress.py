"""The plain progress lines `meshrl train` prints where stdout is not a terminal."""

from __future__ import annotations

import io

import pytest

from meshrl.progress import NoProgress, PlainProgress, ProgressView, progress_view
from meshrl.train import Progress

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def sample(step: int, elapsed: float) -> Progress:
    return Progress(step=step, total_steps=100, policy_version=step, reward_mean=0.25 + step / 400,
                    staleness_mean=0.5, tokens_per_s=1234.0, trainer_state="training", elapsed_s=elapsed)


def test_a_line_every_interval_and_the_last_sample_on_exit() -> None:
    out, clock = io.StringIO(), Clock()
    with PlainProgress(out, interval_s=5.0, clock=clock) as view:
        for i in range(1, 13):  # one poll per second, 12 s
            clock.t = float(i)
            view.update(sample(i, float(i)))
    lines = out.getvalue().splitlines()
    assert lines[0] == "train: starting the mesh ..."
    steps = [line.split()[2] for line in lines[1:]]
    assert steps == ["1/100", "6/100", "11/100", "12/100"]  # t=1, 6, 11, then the final sample
    last = lines[-1]
    for part in ("(12%)", "v12", "reward 0.280", "staleness 0.50", "1234 tok/s", "ETA 1m28s", "[training]"):
        assert part in last, (part, last)


def test_no_duplicate_final_line_when_the_last_sample_was_printed() -> None:
    out, clock = io.StringIO(), Clock()
    with PlainProgress(out, interval_s=5.0, clock=clock) as view:
        view.update(sample(1, 1.0))
    assert len(out.getvalue().splitlines()) == 2


def test_the_view_follows_the_stream_and_the_console_logger() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(progress_view(stream=io.StringIO()), PlainProgress)
    assert isinstance(progress_view(stream=Tty()), ProgressView)
    assert isinstance(progress_view(console=False, stream=io.StringIO()), NoProgress)
