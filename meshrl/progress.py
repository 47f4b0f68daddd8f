"""The terminal progress of `meshrl train` (`trainer.logger` has `console`): step, policy version,
reward, staleness, tokens/s, ETA.

On a terminal a rich progress bar redraws in place. Where stdout is not a TTY (CI logs, `nohup`,
`| tee`, `> log`) a redrawn bar writes nothing useful, so `PlainProgress` prints one plain line
every `interval_s` seconds instead, plus one when the run finishes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from meshrl.train import Progress as RunProgress


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    h, rem = divmod(round(s), 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def describe(p: RunProgress) -> str:
    """The numbers of one progress sample, as both views print them."""
    return (f"v{p.policy_version}  reward {_f(p.reward_mean, '.3f')}  staleness {_f(p.staleness_mean, '.2f')}  "
            f"{_f(p.tokens_per_s, '.0f')} tok/s  queued {p.queued}  in flight {p.in_flight}  "
            f"ETA {_duration(p.eta_s)}  [{p.trainer_state}]")


class ProgressView:
    """The rich bar (interactive terminals)."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("[bold]train[/bold]"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
            TimeElapsedColumn(), TextColumn("{task.fields[info]}"), transient=False,
        )
        self._task = self._bar.add_task("train", total=None, info="starting the mesh ...")

    def __enter__(self) -> ProgressView:
        self._bar.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._bar.stop()

    def update(self, p: RunProgress) -> None:
        self._bar.update(self._task, completed=p.step, total=p.total_steps or None, info=describe(p))


class PlainProgress:
    """One line per `interval_s` seconds (and the last sample on exit) for logs and pipes:

        train step 12/400 (3%)  elapsed 41s  v12  reward 0.413  staleness 0.50  1234 tok/s ...
    """

    def __init__(self, stream: TextIO | None = None, *, interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.interval_s = interval_s
        self.clock = clock
        self._last_print: float | None = None
        self._last: RunProgress | None = None
        self._printed: RunProgress | None = None

    def __enter__(self) -> PlainProgress:
        self._write("train: starting the mesh ...")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._last is not None and self._last is not self._printed:
            self._emit(self._last)

    def update(self, p: RunProgress) -> None:
        self._last = p
        now = self.clock()
        if self._last_print is None or now - self._last_print >= self.interval_s:
            self._last_print = now
            self._emit(p)

    def _emit(self, p: RunProgress) -> None:
        self._printed = p
        total = f"/{p.total_steps} ({100 * p.step / p.total_steps:.0f}%)" if p.total_steps > 0 else ""
        self._write(f"train step {p.step}{total}  elapsed {_duration(p.elapsed_s)}  {describe(p)}")

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


class NoProgress:
    """`console` not in `trainer.logger`: nothing on stdout until the final summary."""

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        return None

    def update(self, p: RunProgress) -> None:
        return None


def progress_view(*, console: bool = True, stream: TextIO | None = None,
                  interval_s: float = 5.0) -> ProgressView | PlainProgress | NoProgress:
    """The view for this stdout: a bar on a terminal, plain lines otherwise, none without `console`."""
    if not console:
        return NoProgress()
    out = stream if stream is not None else sys.stdout
    if out.isatty():
        return ProgressView()
    return PlainProgress(out, interval_s=interval_s)
