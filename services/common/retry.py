"""Bounded retries of a call while the service it reaches is replaced (Serve restarts its replica).

    resp = await retry_transient("CommitVersion", lambda: client.commit_version(...), wait_s=120,
                                 hint="the coordinator is being replaced (... bounds the wait)")

Only transient failures (services.common.errors.transient: UNAVAILABLE, DEADLINE_EXCEEDED, a
replica that died under the call) are retried, with backoff (0.5 s doubling to 5 s), for up to
`wait_s`; anything else is raised at once. The caller makes sure the call is safe to repeat.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.common.errors import first_cause, transient
from services.common.logging import get_logger

log = get_logger(__name__)

T = TypeVar("T")


async def retry_transient(
    what: str, call: Callable[[], Awaitable[T]], *, wait_s: float, hint: str, first_error: BaseException | None = None,
    before: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """`await call()` until it succeeds, retrying transient failures with backoff for up to
    WAIT_S. HINT: what is away and which setting bounds the wait (logged with each retry).
    FIRST_ERROR: a failure already seen (the first call is then a retry). BEFORE: awaited before
    each attempt."""
    deadline = time.monotonic() + wait_s
    delay = 0.5
    error = first_error
    while True:
        if error is not None:
            if not transient(error) or time.monotonic() + delay > deadline:
                raise error
            log.warning("retrying", call=what, error=first_cause(error), retry_in_s=delay, hint=hint)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        if before is not None:
            await before()
        try:
            return await call()
        except Exception as exc:  # noqa: BLE001 -- classified above: only transient failures are retried
            error = exc
