"""Coalescer: batches by size and by time, slices results back, propagates errors."""

from __future__ import annotations

import asyncio

import pytest

from services.common.coalesce import Coalescer


def test_batches_by_size_and_time() -> None:
    calls: list[list[int]] = []

    async def fn(items: list[int]) -> list[int]:
        calls.append(list(items))
        return [i * 10 for i in items]

    async def main() -> None:
        c = Coalescer(fn, max_items=4, max_wait_s=0.05)
        out = await asyncio.gather(c.call([1]), c.call([2, 3]), c.call([4]), c.call([5]))
        assert out == [[10], [20, 30], [40], [50]]
        assert calls[0] == [1, 2, 3, 4]  # full at 4 items: flushed at once
        assert calls[1] == [5]  # the rest after max_wait_s
        assert await c.call([]) == []

    asyncio.run(main())


def test_error_reaches_every_caller_of_the_batch() -> None:
    async def fn(items: list[int]) -> list[int]:
        raise ConnectionError("down")

    async def main() -> None:
        c = Coalescer(fn, max_items=10, max_wait_s=0.01)
        results = await asyncio.gather(c.call([1]), c.call([2]), return_exceptions=True)
        assert all(isinstance(r, ConnectionError) for r in results)

    asyncio.run(main())


def test_wrong_result_count_is_an_error() -> None:
    async def fn(items: list[int]) -> list[int]:
        return [1]

    async def main() -> None:
        c = Coalescer(fn, max_items=10, max_wait_s=0.0)
        with pytest.raises(RuntimeError, match="2 items"):
            await c.call([1, 2])

    asyncio.run(main())


def test_cancelled_caller_does_not_cancel_others() -> None:
    async def fn(items: list[int]) -> list[int]:
        await asyncio.sleep(0.05)
        return items

    async def main() -> None:
        c = Coalescer(fn, max_items=10, max_wait_s=0.01)
        a = asyncio.create_task(c.call([1]))
        b = asyncio.create_task(c.call([2]))
        await asyncio.sleep(0.02)
        a.cancel()
        assert await b == [2]

    asyncio.run(main())
