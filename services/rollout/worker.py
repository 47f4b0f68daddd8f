"""RolloutWorker: one replica's loop — lease → generate → score → submit — and its weight updates.
No Ray, no gRPC server: the coordinator, the scorer and the weight fetcher are injected.

    lease loop    LeasePrompts(free slots) ──► one task per lease (≤ concurrent groups in flight)
    group task    tokenize → engine.generate(n) ─┬─► Score ─► SubmitGroups (retried, idempotent)
                                                 └─ an aborted sample (weight update, mode abort)
                                                    is continued: prompt + its tokens, max_tokens
                                                    reduced by what it has
    renew loop    RenewLeases(in-flight) every lease_renew_interval_s: the heartbeat that keeps the
                  coordinator from taking the replica for dead; a lost lease aborts its group
    watch loop    WatchVersions: a newer version → pause → fetch → load → resume

Weight updates, by async_training.partial_rollout / partial_rollout_mode:
    True / keep   pause("keep"): running samples continue on the new weights with their KV
    True / abort  pause("abort"): running samples end with their partial tokens and are resubmitted
                  (re-prefill with the new weights); new tokens carry the new version
    False         pause("wait"): running samples finish on the old weights; new ones wait
Every token carries the version that produced it; no sample is dropped by an update.

Multi-turn (`actor_rollout_ref.rollout.multi_turn.enable`): the group task hands the prompt to the
AgentLoop (services/rollout/agent), which plays each sample out over turns against its environment
on this same engine; the lease is renewed by the renew loop while tools run, like any group in
flight, and an environment failure returns the lease like any failed group.

Shutdown: drain(finish_in_flight) stops leasing, returns the leases of groups the engine has not
started (and with finish_in_flight=False all others still generating), and waits for the rest to
submit. A lease is released once: submitted, or returned (by drain, or by its task on a failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from meshrl.v1 import common_pb2, coordinator_pb2, reward_pb2, rollout_pb2
from services.common.coalesce import Coalescer
from services.common.errors import FailedPrecondition, InvalidArgument, first_cause, transient
from services.common.logging import get_logger
from services.weights import WeightFetcher
from services.weights.protocols import Bucket

from . import convert
from .agent import group as agent_group
from .agent.loop import AgentLoop
from .engines.base import Finish, GenerationRequest, PauseMode, RolloutEngine, SampleOutput, SamplingSpec, stop_across

log = get_logger(__name__)

Scorer = Callable[[list[reward_pb2.ScoreItem]], Awaitable[list[reward_pb2.ScoreResult]]]
"""Scores a batch of responses (one result per item, matched by item_id)."""

LEASE_LOOP_EXIT_S = 10.0
"""How long drain() waits for a LeasePrompts call under way to answer (it answers in milliseconds;
the bound keeps a hung coordinator from eating serve's graceful_shutdown_timeout_s)."""


class Coordinator(Protocol):
    """The part of services.coordinator.client.CoordinatorClient the worker uses."""

    async def lease(self, replica_id: str, max_groups: int) -> coordinator_pb2.LeasePromptsResponse: ...

    async def renew(self, replica_id: str, lease_ids: Sequence[str]) -> coordinator_pb2.RenewLeasesResponse: ...

    async def return_leases(self, replica_id: str, lease_ids: Sequence[str], error: str = "") -> int: ...

    async def submit(
        self, replica_id: str, groups: Sequence[common_pb2.TrajectoryGroup]
    ) -> coordinator_pb2.SubmitGroupsResponse: ...

    def watch_versions(self, replica_id: str) -> AsyncIterator[coordinator_pb2.WatchVersionsResponse]: ...


@dataclass(frozen=True)
class WorkerSettings:
    replica_id: str = field(default_factory=lambda: f"rollout-{uuid.uuid4().hex[:8]}")
    concurrent_groups: int = 16
    """async_training.concurrent_samples_per_replica: prompt groups in flight."""
    partial_rollout: bool = True
    partial_rollout_mode: PauseMode = "abort"
    renew_interval_s: float = 200.0
    idle_poll_s: float = 0.5
    submit_max_retries: int = 5
    weight_load_timeout_s: float = 600.0
    max_prompt_length: int | None = None
    truncation: convert.Truncation = "error"
    max_resubmits: int = 64
    """async_training.max_resubmits: bound on continuations of one sample (each needs a weight
    update to happen)."""
    batch_window_s: float = 0.005
    """Groups finishing within this window share one SubmitGroups call and one Score call."""
    max_submit_batch: int = 64
    """Groups per SubmitGroups call."""
    max_score_batch: int = 512
    """Items per Score call."""


@dataclass
class _Group:
    lease: coordinator_pb2.PromptLease
    request_id: str
    task: asyncio.Task[None] | None = None
    live: set[str] = field(default_factory=set)
    """Engine request ids running for this group (the first one and any continuations)."""
    cancel_reason: str | None = None
    """Set when the worker itself aborts the group (lease lost, drain): no resubmit, no submit."""
    committed: bool = False
    """The group task owns the lease from here on: set, with no await after the last cancel check,
    when the group goes on to Score and SubmitGroups, or when the task gives the lease back after a
    failure. drain never returns a committed group's lease, so each lease is either submitted or
    returned, once (a failed submit returns it)."""
    agent_started: bool = False
    """A multi-turn group began its trajectories (it may sit in a tool call with no engine request
    live): drain(finish_in_flight=True) lets it finish."""


@dataclass
class WorkerCounters:
    groups_submitted: int = 0
    groups_expired: int = 0
    groups_failed: int = 0
    leases_returned: int = 0
    leases_lost: int = 0
    tokens_generated: int = 0
    resubmits: int = 0
    weight_updates: int = 0
    weight_update_failures: int = 0
    last_weight_load_s: float = 0.0
    busy_s: float = 0.0
    """Seconds with at least one leased group in flight (idle ratio = 1 - busy_s / uptime)."""


class RolloutWorker:
    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        coordinator: Coordinator | None,
        scorer: Scorer | None,
        fetcher: WeightFetcher | None,
        settings: WorkerSettings,
        agent: AgentLoop | None = None,
    ) -> None:
        assert settings.partial_rollout_mode in ("keep", "abort")
        self.agent = agent
        self.engine = engine
        self.tokenizer = tokenizer
        self.coordinator = coordinator
        self.scorer = scorer
        self.fetcher = fetcher
        self.s = settings
        self.counters = WorkerCounters()
        self._groups: dict[str, _Group] = {}
        self._submitter: Coalescer[common_pb2.TrajectoryGroup, int] = Coalescer(
            self._submit_many, max_items=settings.max_submit_batch, max_wait_s=settings.batch_window_s
        )
        self._score_batcher: Coalescer[reward_pb2.ScoreItem, reward_pb2.ScoreResult] | None = (
            # The reward service fails a request as a whole for one bad item: a failure that is not
            # the service's (transient) runs each group's items again alone, so one group's bad
            # item does not fail the others coalesced with it.
            Coalescer(scorer, max_items=settings.max_score_batch, max_wait_s=settings.batch_window_s,
                      retry_alone=lambda exc: not transient(exc))
            if scorer is not None else None
        )
        self._busy_since = time.monotonic()
        self._started_at = time.monotonic()
        self._changed = asyncio.Event()
        self._update_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._lease_task: asyncio.Task[None] | None = None
        self._draining = False
        self._stopping = False
        self._run_error: BaseException | None = None
        self.last_error = ""
        self._to_return: dict[str, str] = {}
        """Leases whose return failed (lease id -> error), retried by the renew loop."""
        """The last group failure, one line (status(); the coordinator has it too)."""
        # The newest version the coordinator announced, and whether loading it failed: then this
        # replica leases nothing (it would only make ever staler data) and retries with backoff.
        self._latest_ref: common_pb2.WeightsRef | None = None
        self._weights_failed = False
        self._weights_retry: asyncio.Task[None] | None = None
        # The version a load broke off in after buckets went in (None: the model holds a whole
        # version): until the engine's version reaches it, the paused engine holds two versions.
        self._partial_version: int | None = None
        # No lease before the first WatchVersions message is handled: a replica that starts on a
        # live run (a resume, a scale-up, a restart) holds the base model until then, and groups
        # generated with it would be trained at any staleness.
        self._synced = False

    @property
    def replica_id(self) -> str:
        return self.s.replica_id

    @property
    def groups_in_flight(self) -> int:
        return len(self._groups)

    @property
    def draining(self) -> bool:
        return self._draining

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout_s: float) -> None:
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the lease, renew and watch loops on the running loop."""
        assert self.coordinator is not None, "the lease loop needs a coordinator"
        loop = asyncio.get_running_loop()
        self._lease_task = loop.create_task(self._lease_loop(), name="rollout-lease")
        self._tasks = [
            self._lease_task,
            loop.create_task(self._renew_loop(), name="rollout-renew"),
            loop.create_task(self._watch_loop(), name="rollout-watch"),
        ]

    @property
    def healthy(self) -> bool:
        """False once a loop died of an exception or a group hit a non-retryable input error."""
        if self._run_error is not None:
            return False
        return not any(t.done() and not t.cancelled() and t.exception() is not None for t in self._tasks)

    async def drain(self, finish_in_flight: bool = True) -> tuple[int, int]:
        """Stop leasing; return the leases of groups not started by the engine (all groups when
        finish_in_flight is False); wait for the others to submit. Returns (returned, finished).
        A group already scoring or submitting (committed) is never returned: it is waited for."""
        self._draining = True
        self._notify()
        # A LeasePrompts call under way when the drain began is waited for: the groups it brings
        # are started before the choice below and returned with the others. Chosen first, they
        # would be generated after the drain (or, cut off by stop(), held until lease expiry).
        # asyncio.wait neither raises the loop's own end nor swallows a cancellation of drain().
        if self._lease_task is not None and not self._lease_task.done():
            await asyncio.wait({self._lease_task}, timeout=LEASE_LOOP_EXIT_S)
        to_return = [
            g for g in self._groups.values()
            if not g.committed and (
                not finish_in_flight or not (g.agent_started or any(self.engine.request_started(r) for r in g.live))
            )
        ]
        # Mark them all before the first await: a group that got past its cancel check while an
        # earlier one was being aborted would be submitted by its task and returned here too.
        for g in to_return:
            g.cancel_reason = "drain"
        # Marked, none of them can submit any more: their prompts go back before the engine is
        # asked to stop, so another replica gets them however long the aborts take (a replica
        # being shut down is killed after serve's graceful_shutdown_timeout_s).
        returned = 0
        ids = [g.lease.lease_id for g in to_return]
        if ids and self.coordinator is not None:
            try:
                returned = await self.coordinator.return_leases(self.replica_id, ids)
            except grpc.RpcError as exc:  # retried by the renew loop while it runs, else they expire: nothing is lost
                log.warning("return_leases_failed", error=str(exc), leases=len(ids))
                self._to_return.update(dict.fromkeys(ids, ""))
        self.counters.leases_returned += returned
        for g in to_return:
            await self._abort_group(g, "drain")
        for g in to_return:
            if g.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await g.task
        before = self.counters.groups_submitted
        remaining = [g.task for g in self._groups.values() if g.task is not None]
        if remaining:
            await asyncio.gather(*remaining, return_exceptions=True)
        return returned, self.counters.groups_submitted - before

    async def stop(self, finish_in_flight: bool = False) -> tuple[int, int]:
        """drain() and stop every loop."""
        result = await self.drain(finish_in_flight)
        if self._weights_retry is not None:
            self._weights_retry.cancel()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.agent is not None:
            await self.agent.aclose()
        return result

    # ---- lease loop ------------------------------------------------------------------------------

    async def _lease_loop(self) -> None:
        assert self.coordinator is not None
        backoff = self.s.idle_poll_s
        while not self._draining and not self._stopping:
            if self._weights_failed or not self._synced:
                await self._wait_change(5.0)
                continue
            free = self.s.concurrent_groups - len(self._groups)
            if free <= 0:
                await self._wait_change(5.0)
                continue
            try:
                resp = await self.coordinator.lease(self.replica_id, free)
            except grpc.RpcError as exc:
                log.warning("lease_failed", code=str(exc.code()), details=exc.details())  # type: ignore[attr-defined]
                await self._wait_change(backoff)
                backoff = min(backoff * 2, self.s.idle_poll_s * 8)
                continue
            for lease in resp.leases:
                self._start_group(lease, resp.sampling)
            if resp.leases:
                backoff = self.s.idle_poll_s
                continue
            if resp.limit == coordinator_pb2.LEASE_LIMIT_STOPPING:
                self._stopping = True
                break
            await self._wait_change(backoff)
            backoff = min(backoff * 2, self.s.idle_poll_s * 8)

    def _start_group(self, lease: coordinator_pb2.PromptLease, sampling: common_pb2.SamplingParams) -> None:
        g = _Group(lease, request_id=f"{self.replica_id}/{lease.lease_id}")
        if not self._groups:
            self._busy_since = time.monotonic()
        self._groups[lease.lease_id] = g
        g.task = asyncio.get_running_loop().create_task(self._run_group(g, sampling), name=f"group-{lease.lease_id}")

    async def _run_group(self, g: _Group, sampling: common_pb2.SamplingParams) -> None:
        try:
            if not await self._weights_for(g):
                return
            n = sampling.n or 1
            spec = convert.sampling_spec(sampling, seed_offset=g.lease.prompt.prompt_seq * n)
            group = await self.generate_group(g.lease.prompt, spec, request_id=g.request_id, lease_id=g.lease.lease_id,
                                              group_state=g, score=True)
            if group is None:
                return
            cut = sum(1 for r in group.responses if r.finish_reason == common_pb2.FINISH_REASON_ABORT)
            if cut:
                # A sample cut short is unfinished: trained, its reward would score an answer it
                # never gave. Its group fails and the prompt goes back to the queue.
                raise FailedPrecondition(
                    f"{cut} of the group's samples were still cut by weight updates after "
                    f"async_training.max_resubmits={self.s.max_resubmits} continuations; not submitted cut "
                    "short (raise it, or set async_training.partial_rollout_mode=keep)"
                )
            await self._submit(group)
        except Exception as exc:
            self.counters.groups_failed += 1
            error = first_cause(exc)
            self.last_error = error
            # The coordinator being away (a restart) is not this group's failure: no error goes with the lease.
            reported = "" if isinstance(exc, grpc.RpcError) and transient(exc) else error
            log.error("group_failed", lease_id=g.lease.lease_id, error=error, exc_info=exc)
            if isinstance(exc, InvalidArgument):
                # Bad input that fails again on any replica (an overlong prompt with
                # data.truncation=error, sampling or a reward item the service rejects): stop
                # this replica so the operator sees it instead of the lease going round. Other
                # errors (a library's ValueError included) fail the group, not the replica.
                self._run_error = exc
                self._draining = True
            if g.cancel_reason != "drain":  # a drained group's lease is drain's to return
                g.committed = True
                await self._give_back(g, reported)
        finally:
            if self._groups.pop(g.lease.lease_id, None) is not None and not self._groups:
                self.counters.busy_s += time.monotonic() - self._busy_since
            self._notify()

    async def _weights_for(self, g: _Group) -> bool:
        """A group leased at version v starts on weights of version v or newer: the coordinator
        granted its lease out of v's staleness budget. Leases can arrive before this replica has
        heard of v or finished loading it; the group waits for the load (the lease is renewed
        meanwhile). False when the group will not run: drained (drain returns the lease), or the
        load failed (the lease is given back now, so another replica takes the prompt)."""
        want = g.lease.policy_version
        while self.fetcher is not None and self.engine.version < want:
            if g.cancel_reason is not None:
                return False
            if self._weights_failed or self._stopping:
                g.committed = True
                await self._give_back(g)
                return False
            await self._wait_change(1.0)
        return g.cancel_reason is None

    async def _give_back(self, g: _Group, error: str = "") -> None:
        """Return a failed group's lease now, so its prompt is re-issued without waiting for expiry.
        ERROR (the group's failure, one line) goes with it: the coordinator counts failures in a
        row and halts leasing with the reason (coordinator.max_consecutive_failures)."""
        if self.coordinator is None:
            return
        try:
            self.counters.leases_returned += await self.coordinator.return_leases(
                self.replica_id, [g.lease.lease_id], error=error
            )
        except grpc.RpcError as exc:
            # Returned by the renew loop once the coordinator answers again: this replica is alive
            # and heartbeats, so the lease would otherwise wait for coordinator.lease_timeout_s.
            self._to_return[g.lease.lease_id] = error
            log.warning("return_lease_failed", lease_id=g.lease.lease_id, code=str(exc.code()))  # type: ignore[attr-defined]

    async def _submit(self, group: common_pb2.TrajectoryGroup) -> None:
        """Submit one group; groups finishing together share a SubmitGroups call (Coalescer)."""
        try:
            (status,) = await self._submitter.call([group])
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
                raise
            # The call it shared passed the message limit (groups that each fit, finishing
            # together): alone it may fit. Submits are idempotent by lease id.
            log.warning("submit_batch_too_large", lease_id=group.lease_id, hint="submitted alone")
            (status,) = await self._submit_many([group])
        if status == coordinator_pb2.SUBMIT_STATUS_EXPIRED:
            self.counters.groups_expired += 1
            log.warning("group_expired_on_submit", lease_id=group.lease_id)
        else:
            self.counters.groups_submitted += 1

    async def _submit_many(self, groups: list[common_pb2.TrajectoryGroup]) -> list[int]:
        """One SubmitGroups call, retried on UNAVAILABLE / DEADLINE_EXCEEDED (idempotent by lease id)."""
        assert self.coordinator is not None
        delay = 0.2
        for attempt in range(self.s.submit_max_retries + 1):
            try:
                resp = await self.coordinator.submit(self.replica_id, groups)
                return list(resp.statuses)
            except grpc.RpcError as exc:
                if not transient(exc) or attempt == self.s.submit_max_retries:
                    raise
                log.warning("submit_retry", groups=len(groups), attempt=attempt + 1, code=str(exc.code()))  # type: ignore[attr-defined]
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    async def _score(self, items: list[reward_pb2.ScoreItem]) -> list[reward_pb2.ScoreResult]:
        """Score through the reward service; items of groups finishing together share a call."""
        assert self._score_batcher is not None
        return await self._score_batcher.call(items)

    # ---- generation ------------------------------------------------------------------------------

    async def generate_group(
        self,
        prompt: common_pb2.Prompt,
        spec: SamplingSpec,
        *,
        request_id: str | None = None,
        lease_id: str = "",
        group_state: _Group | None = None,
        score: bool = True,
    ) -> common_pb2.TrajectoryGroup | None:
        """One group for `prompt` (also the Generate RPC). Returns None when the worker aborted
        it on purpose (lease lost, drain)."""
        rid = request_id or f"{self.replica_id}/gen-{uuid.uuid4().hex[:12]}"
        if self.agent is not None:
            return await self._generate_agent_group(prompt, spec, rid, lease_id, group_state, score)
        encoded = convert.encode_prompt(prompt, self.tokenizer, max_prompt_length=self.s.max_prompt_length,
                                        truncation=self.s.truncation)
        ids = encoded.token_ids
        t0 = time.monotonic()
        outs = await self._generate_tracked(GenerationRequest(rid, ids, spec), group_state)
        outs = await self._continue_aborted(rid, ids, spec, outs, group_state)
        if group_state is not None:
            if group_state.cancel_reason is not None:
                return None
            group_state.committed = True  # no await since the check: drain can no longer return it
        gen_s = time.monotonic() - t0
        self.counters.tokens_generated += sum(len(o) for o in outs)
        group = convert.group(
            lease_id=lease_id or rid, prompt=prompt, prompt_ids=ids, outputs=outs, replica_id=self.replica_id,
            fallback_version=self.engine.version, generation_s=gen_s,
        )
        if score and self.scorer is not None:
            await self._score_group(group, encoded.text, spec)
        return group

    async def _score_group(self, group: common_pb2.TrajectoryGroup, prompt_text: str, spec: SamplingSpec) -> None:
        t1 = time.monotonic()
        text = prompt_text
        results = await self._score(convert.score_items(group, text, spec.max_tokens))
        convert.apply_scores(group, results)
        group.reward_s = time.monotonic() - t1

    async def _generate_agent_group(
        self, prompt: common_pb2.Prompt, spec: SamplingSpec, rid: str, lease_id: str, g: _Group | None, score: bool
    ) -> common_pb2.TrajectoryGroup | None:
        """generate_group for multi-turn trajectories (services/rollout/agent/loop.py)."""
        assert self.agent is not None
        if g is not None:
            g.agent_started = True
        group = await self.agent.play(
            prompt, spec, rid, lease_id or rid, self.replica_id, lambda req: self._generate_tracked(req, g),
            # A leased group is dropped only when the worker aborts it (cancel_reason: lease lost,
            # drain returning it); a drain that finishes in-flight groups lets it finish (agent_started).
            cancelled=lambda: g.cancel_reason is not None if g is not None else self._draining,
            version=lambda: self.engine.version,
        )
        if g is not None:
            if g.cancel_reason is not None:
                return None
            g.committed = True  # no await since the check: drain can no longer return it
        self.counters.tokens_generated += sum(sum(r.loss_mask) for r in group.responses)
        if score and self.scorer is not None and self.agent.s.reward_source != "environment":
            await self._score_group(group, self.tokenizer.decode(list(group.prompt_token_ids), skip_special_tokens=False), spec)
        if score:
            agent_group.apply_reward_source(group, self.agent.s.reward_source)
        return group

    async def _continue_aborted(
        self, rid: str, prompt_ids: list[int], spec: SamplingSpec, outs: list[SampleOutput], g: _Group | None
    ) -> list[SampleOutput]:
        """Partial rollout, mode abort: a sample cut by a weight update goes on from prompt + its
        tokens with max_tokens reduced by what it has (re-prefilled on the new weights)."""
        outs = list(outs)
        for round_ in range(1, self.s.max_resubmits + 1):
            todo = [
                o for o in outs
                # a leased group goes on unless it was given up (a drain that finishes the groups in
                # flight keeps the ones it did not return: cut short, they would be trained so)
                if o.finish_reason == Finish.ABORT and (g.cancel_reason is None if g is not None else not self._draining)
            ]
            if not todo:
                return outs
            conts = []
            for o in todo:
                left = spec.max_tokens - len(o)
                if left <= 0:
                    o.finish_reason = Finish.LENGTH
                    continue
                seed = None if spec.seed is None else spec.seed + o.index + 7919 * round_ + len(o)
                sub = dataclasses.replace(spec, n=1, max_tokens=left, seed=seed)
                req = GenerationRequest(f"{rid}/s{o.index}/r{round_}", prompt_ids + o.token_ids, sub)
                conts.append((o, req))
            if not conts:
                return outs
            self.counters.resubmits += len(conts)
            results = await asyncio.gather(*(self._generate_tracked(req, g) for _, req in conts))
            for (o, _), res in zip(conts, results, strict=True):
                c = res[0]
                boundary = len(o.token_ids)
                o.token_ids.extend(c.token_ids)
                o.logprobs.extend(c.logprobs)
                o.versions.extend(c.versions)
                o.finish_reason = c.finish_reason
                o.num_resumes += 1 + c.num_resumes
                if spec.stop:
                    self._cut_at_boundary_stop(o, boundary, spec.stop)
                o.text = str(self.tokenizer.decode(o.token_ids, skip_special_tokens=True))
        return outs

    def _cut_at_boundary_stop(self, o: SampleOutput, boundary: int, stop: Sequence[str]) -> None:
        """End the sample where a stop string across the continuation's boundary completes."""
        k = stop_across(self._decode_raw, o.token_ids, boundary, stop)
        if k is not None:
            del o.token_ids[k:], o.logprobs[k:], o.versions[k:]
            o.finish_reason = Finish.STOP

    def _decode_raw(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    async def _generate_tracked(self, req: GenerationRequest, g: _Group | None) -> list[SampleOutput]:
        if g is not None:
            if g.cancel_reason is not None:
                return [SampleOutput(index=i) for i in range(req.sampling.n)]
            g.live.add(req.request_id)
        try:
            return await self.engine.generate(req)
        finally:
            if g is not None:
                g.live.discard(req.request_id)

    async def _abort_group(self, g: _Group, reason: str) -> None:
        g.cancel_reason = reason
        for rid in list(g.live):
            await self.engine.abort(rid)

    # ---- leases ----------------------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        assert self.coordinator is not None
        while True:
            await asyncio.sleep(self.s.renew_interval_s)
            await self._retry_returns()
            ids = [lid for lid, g in self._groups.items() if g.cancel_reason is None]
            if not ids:
                continue
            try:
                resp = await self.coordinator.renew(self.replica_id, ids)
            except grpc.RpcError as exc:
                log.warning("renew_failed", code=str(exc.code()), leases=len(ids))  # type: ignore[attr-defined]
                continue
            for lid in resp.lost:
                g = self._groups.get(lid)
                if g is not None:
                    self.counters.leases_lost += 1
                    log.warning("lease_lost", lease_id=lid)
                    await self._abort_group(g, "lost")

    async def _retry_returns(self) -> None:
        """Return the leases whose ReturnLeases failed (idempotent: one submitted or expired since is ignored)."""
        assert self.coordinator is not None
        for error in sorted(set(self._to_return.values())):
            ids = [lid for lid, e in self._to_return.items() if e == error]
            try:
                self.counters.leases_returned += await self.coordinator.return_leases(self.replica_id, ids, error=error)
            except grpc.RpcError as exc:
                log.warning("return_leases_failed", code=str(exc.code()), leases=len(ids))  # type: ignore[attr-defined]
                return
            for lid in ids:
                del self._to_return[lid]

    # ---- weights ---------------------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        assert self.coordinator is not None
        delay = 0.5
        while not self._stopping:
            try:
                async for msg in self.coordinator.watch_versions(self.replica_id):
                    delay = 0.5
                    if msg.stopping:
                        self._stopping = True
                        self._notify()
                    if msg.weights.policy_version > self.engine.version:
                        self._latest_ref = msg.weights
                        await self._load_latest()
                    self._synced = True
                    # A commit resets the coordinator's staleness budget (and pause/resume changes
                    # what may be leased): wake the lease loop instead of letting it sleep out its
                    # backoff.
                    self._notify()
                    if self._stopping:
                        return
            except grpc.RpcError as exc:
                log.warning("watch_versions_broken", code=str(exc.code()))  # type: ignore[attr-defined]
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def _load_latest(self) -> None:
        """Load the newest announced version; on failure stop leasing and retry in the background."""
        ref = self._latest_ref
        if ref is None:
            return
        try:
            await self.update_weights(ref)
            self._weights_failed = False
        except Exception as exc:  # noqa: BLE001 - any failure: retried with backoff, leasing paused
            self.counters.weight_update_failures += 1
            self._weights_failed = True
            log.error("weight_update_failed", version=ref.policy_version, error=repr(exc),
                      hint="this replica leases no prompts until the weights load; retrying")
            self._start_weights_retry()
        self._notify()

    def _start_weights_retry(self) -> None:
        if self._weights_retry is None or self._weights_retry.done():
            self._weights_retry = asyncio.get_running_loop().create_task(self._retry_weights(), name="rollout-weights")

    async def _retry_weights(self) -> None:
        delay = self.s.idle_poll_s
        # Groups in flight wait on the engine a failed load left paused: retried for them while a
        # drain finishes them (stop() cancels this after the drain), else until leasing would stop.
        while self._weights_failed and (self._groups or not (self._stopping or self._draining)):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
            ref = self._latest_ref
            if ref is None or ref.policy_version <= self.engine.version:
                if ref is not None and self.engine.paused:
                    await self.update_weights(ref)  # the version landed after its load gave up: resume
                self._weights_failed = False
                break
            await self._load_latest()
        self._notify()

    async def update_weights(self, ref: common_pb2.WeightsRef) -> float:
        """pause → fetch → load → resume. Returns the seconds it took (0 for an old version)."""
        if self.fetcher is None:
            raise RuntimeError("this replica has no weight fetcher configured")
        async with self._update_lock:
            if ref.policy_version <= self.engine.version:
                # A load whose SetVersion landed after its caller gave up: the model is whole, resume.
                # Not while a broken-off load left part of a newer version in it (the engine's
                # version is still below it): that resumes only once a whole version loads.
                partial = self._partial_version
                if self.engine.paused and (partial is None or self.engine.version >= partial):
                    self._partial_version = None
                    await self.engine.resume()
                return 0.0
            mode: PauseMode = self.s.partial_rollout_mode if self.s.partial_rollout else "wait"
            t0 = time.monotonic()
            buckets = 0

            async def counted(fetched: AsyncIterator[Bucket]) -> AsyncIterator[Bucket]:
                nonlocal buckets
                async for bucket in fetched:
                    buckets += 1
                    yield bucket

            try:
                # In the try: a pause that fails or is cancelled (a `wait` pause drains first) may
                # hold the engine paused all the same; the except resumes it.
                await self.engine.pause(mode)
                n = await asyncio.wait_for(
                    self.engine.load_weights(ref.policy_version, counted(self.fetcher.fetch(ref))),
                    self.s.weight_load_timeout_s,
                )
            except BaseException as exc:
                if buckets and not isinstance(exc, (FailedPrecondition, InvalidArgument)):
                    # Part of the new version may be in the model (a transfer that broke off after
                    # buckets went in): generating now would mix two versions under the old one's
                    # label. It stays paused until a whole version loads (the retry resumes it); its
                    # groups in flight wait, or expire and are re-issued. A refusal (an adapter for
                    # another base, a version that is gone) changes nothing (RolloutEngine.load_weights).
                    log.error("weights_half_loaded", policy_version=ref.policy_version, buckets=buckets,
                              hint="generation stays paused until a whole version loads")
                    self._partial_version = ref.policy_version
                if self._partial_version is not None:
                    # This load, or an earlier one that this one did not replace (a retry that
                    # failed before its first bucket changes nothing), left part of a version in.
                    # Whoever called (WatchVersions, or the UpdateWeights RPC): the retry resumes it.
                    if self._latest_ref is None or ref.policy_version > self._latest_ref.policy_version:
                        self._latest_ref = ref
                    self._weights_failed = True
                    self._start_weights_retry()
                    raise
                await self.engine.resume()
                raise
            self._partial_version = None
            await self.engine.resume()
            dt = time.monotonic() - t0
            self.counters.weight_updates += 1
            self.counters.last_weight_load_s = dt
            log.info("weights_loaded", policy_version=ref.policy_version, tensors=n, mode=mode, seconds=round(dt, 3))
            return dt

    @property
    def announced_version(self) -> int | None:
        """The newest version the coordinator announced (None before the first announcement)."""
        return int(self._latest_ref.policy_version) if self._latest_ref is not None else None

    def _fetcher_stats(self) -> dict[str, float]:
        """What the fetcher says of the last version it received: delta sync's numbers, and a
        sharded fetch's senders and tensors (ShardedFetcher.stats)."""
        from services.weights.delta import fetch_stats

        own = getattr(self.fetcher, "stats", None)
        return {**fetch_stats(self.fetcher), **(own() if callable(own) else {})}

    def status(self) -> rollout_pb2.GetRolloutStatusResponse:
        """GetRolloutStatus's answer (also the deployment's handle call)."""
        c = self.counters
        return rollout_pb2.GetRolloutStatusResponse(
            replica_id=self.replica_id, engine=self.engine.name, policy_version=self.engine.version,
            groups_in_flight=len(self._groups), groups_submitted=c.groups_submitted,
            tokens_generated=c.tokens_generated, paused=self.engine.paused, draining=self._draining,
            engine_stats={**self.engine.stats(), **self._fetcher_stats()}, uptime_s=time.monotonic() - self._started_at,
            busy_s=c.busy_s + (time.monotonic() - self._busy_since if self._groups else 0.0),
            last_weight_load_s=c.last_weight_load_s, weights_failed=self._weights_failed, weights_synced=self._synced,
            groups_expired=c.groups_expired, groups_failed=c.groups_failed, leases_returned=c.leases_returned,
            leases_lost=c.leases_lost, resubmits=c.resubmits, weight_updates=c.weight_updates,
            weight_update_failures=c.weight_update_failures, last_error=self.last_error,
        )
