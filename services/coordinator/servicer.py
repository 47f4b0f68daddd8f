"""CoordinatorService over gRPC: proto in -> core call -> proto out (or a status code).

The same servicer runs under Ray Serve's gRPC proxy (deployment.py) and as a plain grpc.aio server
(server.py). All core calls happen on one asyncio loop, so the core needs no locks. Waiting RPCs
(FetchBatch, WatchVersions) sleep on `_changed`, an event replaced after every state change.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from meshrl.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.common.auth import Authorizer
from services.common.errors import InvalidArgument
from services.common.grpc_util import DEFAULT_MAX_MESSAGE_BYTES, rpc_method
from services.common.limits import Limits, check_lengths, process_limits
from services.common.logging import get_logger

from . import convert, wire
from .core import Batch, CoordinatorCore, Status, audit_ledger, check_int64

log = get_logger(__name__)

MAX_FETCH_GROUPS = 65536
MAX_FETCH_TIMEOUT_MS = 600_000


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Thin shim over CoordinatorCore. Who may call which RPC is the role table's business
    (services/common/auth.py); `auth` holds the tokens it checks behind Serve's proxy."""

    def __init__(
        self,
        core: CoordinatorCore,
        *,
        sampling: common_pb2.SamplingParams,
        auth: Authorizer | None = None,
        max_groups_per_call: int = 1024,
        max_response_tokens: int = 1 << 20,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        vocab_size: int | None = None,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = core
        # ResumeTrainer calls so far: a FetchBatch that waited across one answers without groups
        self._resumes = 0
        # the string limits a submitted group's fields are checked against (its bytes pass the
        # interceptor's check unparsed); None: this process's (`use_role`)
        self.limits = limits
        self.sampling = sampling
        self.auth = auth
        self.max_groups = max_groups_per_call
        self.max_tokens = max_response_tokens
        self.max_message_bytes = max_message_bytes
        self.vocab_size = vocab_size
        self.clock = clock
        self._changed = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None

    # ---- change notification -----------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout_s: float) -> None:
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout=max(0.0, timeout_s))
        except TimeoutError:
            pass

    def start_sweeper(self, interval_s: float = 1.0) -> None:
        """Expire leases on a timer too, so waiting trainers see re-issued work promptly. It ticks
        at most replica_ttl_s / 8 apart, the cadence liveness.py assumes: checks further apart than
        replica_ttl_s / 4 read as a coordinator stall and credit every lease holder, so with only
        this timer checking, a dead replica would never be found silent."""
        ttl = self.core.settings.replica_ttl_s
        if ttl is not None:
            interval_s = min(interval_s, ttl / 8)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(interval_s))

    async def _sweep(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                if self.core.expire(self.clock()):
                    self._notify()
            except Exception as exc:  # noqa: BLE001 -- e.g. a ledger write failed: next tick tries again (calls expire too)
                log.warning("coordinator_sweep_failed", error=f"{type(exc).__name__}: {exc}")

    # ---- rollout side --------------------------------------------------------------------------

    @rpc_method()
    async def LeasePrompts(self, request: coordinator_pb2.LeasePromptsRequest, context: Any) -> coordinator_pb2.LeasePromptsResponse:
        convert.require_id(request.replica_id, "replica_id")
        convert.check_count(request.max_groups, "max_groups", 1, self.max_groups)
        limit = convert.reply_limit(self.max_message_bytes, request)
        grant = self.core.lease(
            request.replica_id, request.max_groups, self.clock(),
            max_reply_bytes=limit - convert.LEASE_REPLY_OVERHEAD - self.sampling.ByteSize(),
            lease_bytes=convert.lease_wire_bytes,
        )
        return convert.lease_response(grant, self.sampling)

    @rpc_method()
    async def RenewLeases(self, request: coordinator_pb2.RenewLeasesRequest, context: Any) -> coordinator_pb2.RenewLeasesResponse:
        convert.require_id(request.replica_id, "replica_id")
        convert.check_count(len(request.lease_ids), "lease_ids", 1, self.max_groups)
        renewed, lost, deadline = self.core.renew(request.replica_id, list(request.lease_ids), self.clock())
        return coordinator_pb2.RenewLeasesResponse(renewed=renewed, lost=lost, deadline_unix_s=deadline)

    @rpc_method()
    async def ReturnLeases(self, request: coordinator_pb2.ReturnLeasesRequest, context: Any) -> coordinator_pb2.ReturnLeasesResponse:
        convert.require_id(request.replica_id, "replica_id")
        convert.check_count(len(request.lease_ids), "lease_ids", 1, self.max_groups)
        now = self.clock()
        n = self.core.return_leases(request.replica_id, list(request.lease_ids), now, request.error)
        if request.error and n:
            # the leases this call returned: a resent request (its first reply lost), unknown or
            # already settled ids count nothing, and a failed return counts nothing either
            self.core.report_failure(request.replica_id, request.error, n, now)
        if n:
            self._notify()
        return coordinator_pb2.ReturnLeasesResponse(returned=n)

    @rpc_method()
    async def SubmitGroups(
        self, request: bytes | coordinator_pb2.SubmitGroupsRequest, context: Any
    ) -> coordinator_pb2.SubmitGroupsResponse:
        """`request` arrives as bytes over gRPC (wire.add_to_server) or as a message in-process."""
        raw = wire.as_raw_submit(request, self.max_groups)
        if isinstance(request, bytes):  # the generic length check saw bytes, not the groups
            limits = self.limits or process_limits()
            for i, g in enumerate(raw.groups):
                check_lengths(g, limits, f"groups[{i}]")
        groups = convert.groups_from_request(
            raw, max_groups=self.max_groups, max_tokens=self.max_tokens, expected_n=self.sampling.n or None,
            vocab_size=self.vocab_size,
        )
        statuses = self.core.submit(raw.replica_id, groups, self.clock())
        self._notify()
        return convert.submit_response(statuses, self.core.queued)

    async def _watch(self) -> AsyncIterator[tuple[int, bytes, bool, bool]]:
        last: tuple[int, bool, bool] | None = None
        while True:
            version, weights = self.core.announced()
            state = (version, self.core.paused, self.core.stopping)
            if state != last:
                last = state
                yield version, weights, state[1], state[2]
                if state[2]:
                    return
            await self._wait_change(30.0)

    @rpc_method()
    async def WatchVersions(
        self, request: coordinator_pb2.WatchVersionsRequest, context: Any
    ) -> AsyncIterator[coordinator_pb2.WatchVersionsResponse]:
        convert.require_id(request.replica_id, "replica_id")
        async for version, weights, paused, stopping in self._watch():
            yield coordinator_pb2.WatchVersionsResponse(
                weights=convert.weights_ref(weights, version), paused=paused, stopping=stopping
            )

    # ---- trainer side --------------------------------------------------------------------------

    @rpc_method()
    async def FetchBatch(  # type: ignore[override]
        self, request: coordinator_pb2.FetchBatchRequest, context: Any
    ) -> wire.SerializedReply:
        """The reply is already serialized around the stored group bytes (wire.fetch_reply)."""
        convert.require_id(request.trainer_id, "trainer_id")
        convert.check_count(request.num_groups, "num_groups", 1, MAX_FETCH_GROUPS)
        convert.check_count(request.timeout_ms, "timeout_ms", 0, MAX_FETCH_TIMEOUT_MS)
        # each id costs a lookup (a ledger read for one a checkpoint consumed)
        convert.check_count(len(request.filtered_lease_ids), "filtered_lease_ids", 0, MAX_FETCH_GROUPS)
        check_int64(request.step, "step")
        train_version = request.train_version if request.HasField("train_version") else None
        self.core.check_train_version(train_version)
        limit = convert.reply_limit(self.max_message_bytes, request)
        deadline = time.monotonic() + request.timeout_ms / 1000.0
        core = self.core
        resumes = self._resumes
        while (
            (core.queued < request.num_groups or core.paused)
            and not core.exhausted
            and not core.stopping
            and time.monotonic() < deadline
        ):
            await self._wait_change(deadline - time.monotonic())
        if self._resumes != resumes:
            # The trainer re-synced while this call waited: it gave this call up (its answer lost
            # behind a proxy that died, a half-open connection) and collects the step again.
            # Groups delivered here would reach nobody, and its checkpoint of the step would
            # mark them consumed: none are delivered.
            log.warning("fetch_abandoned", trainer_id=request.trainer_id, step=request.step,
                        reason="a ResumeTrainer came while it waited")
            return convert.batch_response(Batch([], core.policy_version, core.exhausted, False, core.stopping, 0))
        batch = core.fetch(
            request.trainer_id, request.step, request.num_groups, self.clock(), list(request.filtered_lease_ids),
            train_version, max_reply_bytes=limit,
        )
        if batch.regenerated or request.filtered_lease_ids:
            self._notify()  # budget given back: rollouts may lease again
        return convert.batch_response(batch)

    @rpc_method()
    async def CommitVersion(self, request: coordinator_pb2.CommitVersionRequest, context: Any) -> coordinator_pb2.CommitVersionResponse:
        convert.require_id(request.trainer_id, "trainer_id")
        if not request.HasField("weights"):
            raise InvalidArgument("weights", "missing (the WeightsRef of the new version)")
        version, budget = self.core.commit_version(request.weights.policy_version, convert.weights_bytes(request.weights))
        log.info("version_committed", policy_version=version, budget_used=budget)
        self._notify()
        return coordinator_pb2.CommitVersionResponse(
            policy_version=version, budget_used=budget, stopping=self.core.stopping
        )

    @rpc_method()
    async def ReportCheckpoint(
        self, request: coordinator_pb2.ReportCheckpointRequest, context: Any
    ) -> coordinator_pb2.ReportCheckpointResponse:
        convert.require_id(request.trainer_id, "trainer_id")
        convert.check_length(request.path, "path", convert.MAX_PATH_CHARS)
        self.core.report_checkpoint(request.step, request.policy_version, request.path)
        self._notify()
        return coordinator_pb2.ReportCheckpointResponse()

    @rpc_method()
    async def ResumeTrainer(self, request: coordinator_pb2.ResumeTrainerRequest, context: Any) -> coordinator_pb2.ResumeTrainerResponse:
        convert.require_id(request.trainer_id, "trainer_id")
        n = self.core.resume_trainer(request.checkpoint_step)
        self._resumes += 1
        log.info("trainer_resumed", checkpoint_step=request.checkpoint_step, requeued=n)
        self._notify()
        return coordinator_pb2.ResumeTrainerResponse(requeued=n, policy_version=self.core.policy_version)

    # ---- operator --------------------------------------------------------------------------------

    @rpc_method()
    async def GetStatus(self, request: coordinator_pb2.GetStatusRequest, context: Any) -> coordinator_pb2.GetStatusResponse:
        return convert.status_response(self.status())

    def status(self) -> Status:
        """The core's Status now. Leases past their deadline expire first and the waiters hear of
        it (core.status alone would expire them silently: the sweeper then finds nothing to
        announce and a waiting FetchBatch sleeps until its own timeout)."""
        now = self.clock()
        if self.core.expire(now):
            self._notify()
        return self.core.status(now)

    async def audit(self) -> dict[str, Any]:
        """The ledger audit (CoordinatorCore.audit), read in a thread on a connection of its own:
        it scans every lease and group of the run, seconds on a long one, and on the loop every
        RPC (renewals, leases, FetchBatch) waited for it. A ledger without WAL (":memory:", or on a
        filesystem that refused it) is read here: there a reader in a thread would block the
        RPCs' writes, which fail with "database is locked" after the busy timeout."""
        ledger = self.core.ledger
        if not ledger.wal:
            return self.core.audit()
        return await asyncio.to_thread(audit_ledger, ledger)

    @rpc_method()
    async def Pause(self, request: coordinator_pb2.PauseRequest, context: Any) -> coordinator_pb2.PauseResponse:
        self.core.set_paused(True)
        log.info("run_paused")
        self._notify()
        return coordinator_pb2.PauseResponse()

    @rpc_method()
    async def Resume(self, request: coordinator_pb2.ResumeRequest, context: Any) -> coordinator_pb2.ResumeResponse:
        self.core.set_paused(False)
        log.info("run_resumed")
        self._notify()
        return coordinator_pb2.ResumeResponse()

    @rpc_method()
    async def SetStaleness(self, request: coordinator_pb2.SetStalenessRequest, context: Any) -> coordinator_pb2.SetStalenessResponse:
        max_required = self.core.set_staleness(request.staleness_threshold)
        log.info("staleness_set", staleness_threshold=request.staleness_threshold, max_required_samples=max_required)
        self._notify()
        return coordinator_pb2.SetStalenessResponse(max_required_samples=max_required)

    @rpc_method()
    async def RequestCheckpoint(
        self, request: coordinator_pb2.RequestCheckpointRequest, context: Any
    ) -> coordinator_pb2.RequestCheckpointResponse:
        self.core.request_checkpoint()
        self._notify()
        return coordinator_pb2.RequestCheckpointResponse()

    @rpc_method()
    async def Stop(self, request: coordinator_pb2.StopRequest, context: Any) -> coordinator_pb2.StopResponse:
        self.core.stop()
        log.info("run_stopping")
        self._notify()
        return coordinator_pb2.StopResponse()

    @rpc_method()
    async def Echo(self, request: coordinator_pb2.EchoRequest, context: Any) -> coordinator_pb2.EchoResponse:
        return coordinator_pb2.EchoResponse(payload=request.payload)
