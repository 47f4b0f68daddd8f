"""The trainer's bounded retries while a service it calls is replaced by Serve.

Which calls are retried, and why each is safe:

    CommitVersion      idempotent (re-committing the current version with the same weights is a no-op)
    ReportCheckpoint   idempotent (the same step again changes nothing)
    PublishWeights     a param server that died mid-upload kept nothing; the version is published
                       again to its replacement, from the group's weights as they are then
    FetchBatch         not idempotent: the dead call may have delivered groups whose answer never
                       came. The loop re-syncs instead (TrainerLoop._resync: ResumeTrainer puts
                       every group delivered for the steps not trained back at the head of the
                       queue) and collects the step again.

Only transient failures (services.common.errors.transient: UNAVAILABLE, DEADLINE_EXCEEDED, a
replica that died under the call) are retried, with backoff, for up to
`trainer_service.coordinator_wait_s`; anything else fails the loop at once.
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
    what: str, call: Callable[[], Awaitable[T]], *, wait_s: float, first_error: BaseException | None = None,
    before: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """`await call()` until it succeeds, retrying transient failures with backoff (0.5 s doubling
    to 5 s) for up to WAIT_S. FIRST_ERROR: a failure already seen (the first call is then a retry).
    BEFORE: awaited before each attempt."""
    deadline = time.monotonic() + wait_s
    delay = 0.5
    error = first_error
    while True:
        if error is not None:
            if not transient(error) or time.monotonic() + delay > deadline:
                raise error
            log.warning("retrying", call=what, error=first_cause(error), retry_in_s=delay,
                        hint="a service is being replaced (trainer_service.coordinator_wait_s bounds the wait)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        if before is not None:
            await before()
        try:
            return await call()
        except Exception as exc:  # noqa: BLE001 -- classified above: only transient failures are retried
            error = exc
