"""Ctrl-C during `meshrl train`'s watch loop: the first asks for a clean stop and the loop goes on
until the trainer finishes; the second aborts. The signal is handled between event-loop steps, so
callbacks that complete futures (gRPC, Serve handles, other threads) are never cut in half."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from meshrl.train import Progress, _watch


class _Run:
    """The part of MeshRun that _watch drives: a watch loop fed by another thread, as the
    Serve handle's router thread feeds the driver's awaits."""

    def __init__(self, finish_after_stop_s: float | None) -> None:
        self.interrupts = 0
        self.stop_requested_at: float | None = None
        self.finish_after_stop_s = finish_after_stop_s
        self.replies = 0

    def request_stop(self) -> None:
        self.stop_requested_at = time.monotonic()

    async def watch(self, on_progress: Callable[[Progress], None]) -> Progress:
        loop = asyncio.get_running_loop()
        while True:
            fut: asyncio.Future[int] = loop.create_future()
            # A reply completed from another thread, many times a second.
            threading.Timer(0.001, _reply, (loop, fut)).start()
            self.replies += await fut
            on_progress(Progress(step=self.replies))
            if (self.stop_requested_at is not None and self.finish_after_stop_s is not None
                    and time.monotonic() - self.stop_requested_at >= self.finish_after_stop_s):
                return Progress(step=self.replies, trainer_state="finished")


def _reply(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[int]) -> None:
    def deliver() -> None:
        if not fut.done():  # cancelled by the abort
            fut.set_result(1)

    with contextlib.suppress(RuntimeError):  # the loop is closed after an abort
        loop.call_soon_threadsafe(deliver)


def _sigint_after(*delays: float) -> None:
    def send() -> None:
        for d in delays:
            time.sleep(d)
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=send, daemon=True).start()


def test_first_ctrl_c_requests_a_clean_stop_and_the_watch_runs_to_the_end() -> None:
    run = _Run(finish_after_stop_s=0.5)
    _sigint_after(0.3)
    progress = _watch(run, lambda p: None)  # type: ignore[arg-type]
    assert progress.trainer_state == "finished"
    assert run.interrupts == 1 and run.stop_requested_at is not None
    # The watch kept running (and replies kept arriving) after the stop was asked for.
    assert run.replies > 10
    # The default handler is back: a later Ctrl-C is a KeyboardInterrupt again.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_second_ctrl_c_aborts() -> None:
    run = _Run(finish_after_stop_s=None)  # never finishes on its own
    _sigint_after(0.2, 0.3)
    with pytest.raises(KeyboardInterrupt):
        _watch(run, lambda p: None)  # type: ignore[arg-type]
    assert run.interrupts == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
