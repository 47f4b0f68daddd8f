"""The terminal progress view of `meshrl train` (rich): step, policy version, reward, staleness,
tokens/s, ETA."""

from __future__ import annotations

from types import TracebackType

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from meshrl.train import Progress as RunProgress


class ProgressView:
    def __init__(self) -> None:
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
        def f(x: float | None, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        eta = p.eta_s
        info = (f"v{p.policy_version}  reward {f(p.reward_mean, '.3f')}  staleness {f(p.staleness_mean, '.2f')}  "
                f"{f(p.tokens_per_s, '.0f')} tok/s  queued {p.queued}  in flight {p.in_flight}  "
                f"ETA {'-' if eta is None else f'{eta:.0f}s'}  [{p.trainer_state}]")
        self._bar.update(self._task, completed=p.step, total=p.total_steps or None, info=info)
