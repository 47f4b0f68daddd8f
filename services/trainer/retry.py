"""The trainer's bounded retries while a service it calls is replaced by Serve.

Which calls are retried, and why each is safe:

    CommitVersion      idempotent (re-committing the current version with the same weights is a no-op)
    ReportCheckpoint   idempotent (the same step again changes nothing)
    PublishWeights     a param server that died mid-upload kept nothing; the version is published
                       again to its replacement, from the group's weights as they are then. A live
                       one answers UNAVAILABLE while the attempt given up on still holds the
                       version's upload slot or one of max_concurrent_uploads, DEADLINE_EXCEEDED
                       to a stream it dropped as stalled
    FetchBatch         not idempotent: the dead call may have delivered groups whose answer never
                       came. The loop re-syncs instead (TrainerLoop._resync: ResumeTrainer puts
                       every group delivered for the steps not trained back at the head of the
                       queue) and collects the step again.

Only transient failures (services.common.errors.transient: UNAVAILABLE, DEADLINE_EXCEEDED, a
replica that died under the call) are retried, with backoff, for up to
`trainer_service.coordinator_wait_s` (services/common/retry.py); anything else fails the loop at once.
"""

from __future__ import annotations

import functools

from services.common import retry

retry_transient = functools.partial(
    retry.retry_transient, hint="a service is being replaced (trainer_service.coordinator_wait_s bounds the wait)"
)
