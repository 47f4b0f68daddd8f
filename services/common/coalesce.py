"""Coalesce many small async calls into few batched ones (micro-batching).

    submit = Coalescer(client_submit_many, max_items=64, max_wait_s=0.005)
    statuses = await submit.call([group])      # joins whatever else arrives within 5 ms

A batch is flushed when it holds `max_items` items or `max_wait_s` after its first item arrived,
whichever comes first. `fn` takes the concatenated items and must return one result per item, in
order; each caller gets the slice for its own items. If `fn` raises, every caller of that batch
gets the exception (callers retry as they would have without batching), unless `retry_alone`
accepts it: then each caller's items run again on their own, and only the callers whose own items
fail get an error (a reward request fails as a whole for one bad item). Cancelling a caller does
not cancel the batch: the other callers still get their results.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    def __init__(
        self, fn: Callable[[list[T]], Awaitable[Sequence[R]]], *, max_items: int, max_wait_s: float,
        retry_alone: Callable[[Exception], bool] | None = None,
    ) -> None:
        if max_items < 1:
            raise ValueError("max_items must be >= 1")
        self.fn = fn
        self.retry_alone = retry_alone
        self.max_items = max_items
        self.max_wait_s = max_wait_s
        self._pending: list[tuple[list[T], asyncio.Future[list[R]]]] = []
        self._count = 0
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.items = 0

    async def call(self, items: Sequence[T]) -> list[R]:
        if not items:
            return []
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[R]] = loop.create_future()
        self._pending.append((list(items), fut))
        self._count += len(items)
        if self._count >= self.max_items or self.max_wait_s <= 0:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.max_wait_s, self._flush)
        return await asyncio.shield(fut)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending:
            return
        batch, self._pending, self._count = self._pending, [], 0
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[list[T], asyncio.Future[list[R]]]], *, count: bool = True) -> None:
        flat = [item for items, _ in batch for item in items]
        if count:  # a caller's run alone after its batch failed is not another batch
            self.batches += 1
            self.items += len(flat)
        try:
            results = list(await self.fn(flat))
            if len(results) != len(flat):
                raise RuntimeError(f"batched call returned {len(results)} results for {len(flat)} items")
        except Exception as exc:  # noqa: BLE001 -- whatever fn raised: its callers', or retried alone
            if self.retry_alone is not None and len(batch) > 1 and self.retry_alone(exc):
                await asyncio.gather(*(self._run([entry], count=False) for entry in batch if not entry[1].done()))
                return
            self._fail(batch, exc)
            return
        except BaseException as exc:  # noqa: BLE001 -- handed to every caller of this batch
            self._fail(batch, exc)
            return
        start = 0
        for items, fut in batch:
            if not fut.done():
                fut.set_result(results[start : start + len(items)])
            start += len(items)

    @staticmethod
    def _fail(batch: list[tuple[list[T], asyncio.Future[list[R]]]], exc: BaseException) -> None:
        for _, fut in batch:
            if not fut.done():
                fut.set_exception(exc)
