"""A thread pool for scorers that block (Math-Verify, sandboxes, user functions), with a deadline
per call that never stalls the event loop or the calls queued behind it.

    pool = BlockingPool(num_workers=2)
    result = await pool.run(fn, {"solution_str": ...}, timeout_s=10.0)   # ScoreDeadline past 10 s

Timeline of one call: it waits (without a deadline) for one of `num_workers` slots, is submitted
to the current executor, and from then on has `timeout_s`. A Python thread cannot be killed, so a
call that times out (or whose caller is cancelled while it runs) is *abandoned*: its slot is freed, the executor is replaced by a fresh one
(later calls never queue behind the stuck thread) and the old executor is shut down without
waiting, so its threads exit once their work ends. `abandoned` counts timed-out calls still
running; a replica whose count keeps growing should be replaced (the deployment's health check
does that), which is the only way to stop a runaway computation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from typing import Any

from services.common.logging import get_logger

log = get_logger(__name__)


class ScoreDeadline(Exception):
    """A scorer call ran past the pipeline's deadline. Not a TimeoutError: one the scorer raises
    itself (a socket, a judge's client library) is its own error, never taken for the deadline."""


class BlockingPool:
    """Run blocking callables off the event loop with a per-call deadline (see module docstring).
    Use from one event loop."""

    def __init__(self, num_workers: int, *, name: str = "reward-scorer") -> None:
        assert num_workers >= 1
        self.num_workers = num_workers
        self.name = name
        self._generation = 0
        self._executor = self._new_executor()
        self._slots: asyncio.Semaphore | None = None
        self._abandoned: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        self.timeouts = 0
        self.calls = 0

    def _new_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        self._generation += 1
        return concurrent.futures.ThreadPoolExecutor(self.num_workers, thread_name_prefix=f"{self.name}-{self._generation}")

    @property
    def abandoned(self) -> int:
        """Abandoned calls (timed out, or their caller cancelled) whose threads are still running."""
        with self._lock:
            return len(self._abandoned)

    async def run(self, fn: Callable[..., Any], kwargs: Mapping[str, Any], *, timeout_s: float) -> Any:
        """fn(**kwargs) on a worker thread. Raises ScoreDeadline when it runs longer than
        `timeout_s`, or whatever fn raised."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.num_workers)
        async with self._slots:
            self.calls += 1
            cfut = self._executor.submit(fn, **kwargs)
            afut = asyncio.wrap_future(cfut)
            try:
                return await asyncio.wait_for(asyncio.shield(afut), timeout_s)
            except TimeoutError:
                if afut.done():
                    raise  # fn's own TimeoutError
                self.timeouts += 1
                self._abandon(cfut, afut)
                raise ScoreDeadline(f"ran past {timeout_s:g} s") from None
            except asyncio.CancelledError:
                # The caller left (a client deadline, a drain). A call still queued is dropped; one
                # already running keeps its thread past this slot: abandoned like a timeout, else
                # the next call would queue behind it and time out without ever running.
                if not cfut.cancel():
                    self._abandon(cfut, afut)
                raise

    def _abandon(self, cfut: concurrent.futures.Future[Any], afut: asyncio.Future[Any]) -> None:
        with self._lock:
            self._abandoned.add(cfut)

        def finished(f: concurrent.futures.Future[Any]) -> None:
            with self._lock:
                self._abandoned.discard(f)

        cfut.add_done_callback(finished)
        # Nobody awaits the asyncio side any more: consume its outcome so it is not reported as
        # "exception never retrieved".
        afut.add_done_callback(lambda f: f.cancelled() or f.exception())
        old, self._executor = self._executor, self._new_executor()
        old.shutdown(wait=False, cancel_futures=False)
        log.warning("scorer_call_abandoned", pool=self.name, abandoned=self.abandoned, timeouts=self.timeouts)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
