"""The coordinator's logic: leases, the staleness budget, the trajectory queue, versions.

No Ray, no gRPC, no wall clock: every method takes `now` (seconds since the epoch) so tests drive
time. Every state change is written to the ledger in one transaction before the method returns;
`CoordinatorCore.open` on an existing ledger continues the run exactly where it stood.

A prompt's life (seq = its number in the run's prompt stream):

    cursor ──lease──▶ in flight ──submit──▶ queued ──fetch──▶ delivered ──checkpoint──▶ consumed
      ▲                  │  expire/return           │ stale (> eta)      │ filtered (DAPO)
      └──── retry ◀──────┴──────────────────────────┘                    ▼
                                                                      filtered
    A trainer that resumes from checkpoint step S sends groups delivered after S back to the
    head of the queue (or, if their payload was not kept, their prompts back to retry).

Staleness budget (verl's rule, counted in prompts):
    required_samples     = ppo_mini_batch_size * require_batches
    max_required_samples = int(required_samples * (1 + staleness_threshold) * trigger_parameter_sync_step)
    grant while budget_used < max_required_samples; budget_used += 1 per granted lease; at each
    version commit budget_used := in_flight + queued. A prompt that leaves without being trained
    (expired, returned, stale, filtered) gives its unit back, never below in_flight + queued.
"""

from __future__ import annotations

import heapq
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from services.common.config.root import max_required_samples
from services.common.data import PromptRecord, PromptStream
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.logging import get_logger

from .failures import FailureLog, FailureReport
from .ledger import GroupRow, GroupState, LeaseRow, LeaseState, Ledger, RetryReason
from .liveness import ReplicaLiveness

log = get_logger(__name__)


@dataclass(frozen=True)
class CoordinatorSettings:
    """What the core needs from the config (see services.common.config.derive)."""

    required_samples: int
    staleness_threshold: float
    trigger_parameter_sync_step: int
    prompts_total: int
    lease_timeout_s: float
    max_staleness_versions: int | None = None
    keep_delivered_payloads: bool = True
    run_id: str = ""
    # Which start of the mesh this is (one per `meshrl train` invocation; Serve restarts of the
    # replica keep it). A Stop belongs to the session that asked for it: a later session that
    # continues the same ledger (`meshrl train --resume`) starts un-stopped.
    session: str = ""
    replica_ttl_s: float | None = None
    """A replica holding leases and silent this long is taken for dead (see liveness.py); None: off."""
    max_consecutive_failures: int | None = None
    """Failed groups in a row that halt leasing (see failures.py); None: never."""

    def fingerprint(self) -> dict[str, Any]:
        """Facts a ledger must agree with to be continued by this config."""
        return {"prompts_total": self.prompts_total, "required_samples": self.required_samples}


class LeaseLimit(Enum):
    NONE = "none"
    STALENESS_BUDGET = "staleness_budget"
    PAUSED = "paused"
    EXHAUSTED = "exhausted"
    STOPPING = "stopping"


class SubmitStatus(Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    EXPIRED = "expired"


@dataclass(frozen=True)
class GrantedLease:
    lease_id: str
    seq: int
    prompt: PromptRecord
    deadline: float
    policy_version: int


@dataclass(frozen=True)
class LeaseGrant:
    leases: list[GrantedLease]
    limit: LeaseLimit
    policy_version: int


@dataclass(frozen=True)
class GroupIn:
    """A submitted group, already parsed and validated for shape by the servicer."""

    lease_id: str
    seq: int
    min_version: int
    max_version: int
    payload: bytes


@dataclass(frozen=True)
class DeliveredGroup:
    lease_id: str
    seq: int
    staleness: int
    payload: bytes


@dataclass(frozen=True)
class Batch:
    groups: list[DeliveredGroup]
    policy_version: int
    exhausted: bool
    checkpoint_requested: bool
    stop_requested: bool
    regenerated: int


@dataclass
class _Queued:
    group_id: int
    lease_id: str
    seq: int
    min_version: int
    qpos: int
    payload: bytes


@dataclass
class _Delivered:
    group_id: int
    lease_id: str
    seq: int
    min_version: int
    step: int
    staleness: int
    qpos: int
    payload: bytes | None

    @property
    def train_version(self) -> int:
        """The version the trainer fetched it to be trained at."""
        return self.min_version + self.staleness


@dataclass
class Totals:
    prompts_issued: int = 0
    leases_granted: int = 0
    leases_expired: int = 0
    leases_returned: int = 0
    consumed: int = 0
    regenerated: int = 0
    filtered: int = 0
    duplicates: int = 0
    rejected_expired: int = 0
    late_accepted: int = 0
    submitted: int = 0
    leases_replica_lost: int = 0
    """Of leases_expired: those expired early because their replica went silent (replica_ttl_s)."""


@dataclass
class _State:
    run_id: str
    fingerprint: dict[str, Any]
    policy_version: int = 0
    weights: dict[str, Any] = field(default_factory=dict)
    cursor: int = 0
    budget_used: int = 0
    staleness_threshold: float = 0.0
    paused: bool = False
    stopping: bool = False
    stop_session: str = ""
    stop_version: int = 0
    """policy_version at the Stop: the last version rollouts are told of (WatchVersions)."""
    stop_weights: dict[str, Any] = field(default_factory=dict)
    checkpoint_requested: bool = False
    trainer_step: int = 0
    last_checkpoint_step: int = -1
    last_checkpoint_path: str = ""
    next_qpos: int = 0
    min_qpos: int = 0
    totals: Totals = field(default_factory=Totals)
    histogram: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["totals"] = dict(self.totals.__dict__)
        d["histogram"] = {str(k): v for k, v in self.histogram.items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _State:
        d = dict(d)
        d["totals"] = Totals(**d["totals"])
        d["histogram"] = {int(k): v for k, v in d["histogram"].items()}
        return cls(**d)


@dataclass(frozen=True)
class Status:
    run_id: str
    policy_version: int
    paused: bool
    stopping: bool
    staleness_threshold: float
    required_samples: int
    max_required_samples: int
    budget_used: int
    max_staleness_versions: int | None
    prompts_total: int
    in_flight: int
    queued: int
    retry_pending: int
    delivered_uncheckpointed: int
    totals: Totals
    histogram: dict[int, int]
    trainer_step: int
    last_checkpoint_step: int
    checkpoint_requested: bool
    active_replicas: list[str]
    weights: dict[str, Any]
    failures: list[FailureReport] = field(default_factory=list)
    halted_reason: str = ""


class CoordinatorCore:
    """See the module docstring. One owner; methods are not thread-safe."""

    def __init__(self, settings: CoordinatorSettings, prompts: PromptStream, ledger: Ledger) -> None:
        self.settings = settings
        self.prompts = prompts
        self.ledger = ledger
        self._leases: dict[str, LeaseRow] = {}
        # (deadline, prompt seq, lease id): ties break on seq so expiry order is reproducible
        self._deadlines: list[tuple[float, int, str]] = []
        # lease id -> seq of leases that expired or were returned: a late answer is still taken
        # while the prompt waits for re-issue (see submit)
        self._expired: dict[str, int] = {}
        self._refused: set[str] = set()
        self._submitted: set[str] = set()
        self._retry: OrderedDict[int, None] = OrderedDict()
        self._queue: OrderedDict[int, _Queued] = OrderedDict()
        self._delivered: dict[str, _Delivered] = {}
        # Delivered groups fetched ahead (to train at the next version): they count against the
        # budget like queued ones until that version is committed.
        self._ahead = 0
        self._next_group_id = 1
        self._replica_seen: dict[str, float] = {}
        self._liveness = ReplicaLiveness(self._replica_seen, settings.replica_ttl_s)
        self.failures = FailureLog(settings.max_consecutive_failures)
        snap = ledger.load()
        if snap.state is None:
            self._s = _State(
                run_id=settings.run_id or uuid.uuid4().hex[:12],
                fingerprint=settings.fingerprint(),
                staleness_threshold=settings.staleness_threshold,
            )
            with ledger.transaction():
                ledger.save_state(self._s.to_json())
            return
        state = _State.from_json(snap.state)
        if state.fingerprint != settings.fingerprint():
            raise FailedPrecondition(
                f"ledger {ledger.path} belongs to a run with {state.fingerprint}, but this config gives "
                f"{settings.fingerprint()}; use the same data and batch settings, or a new coordinator.ledger_path"
            )
        if state.stopping and state.stop_session != settings.session:
            # The Stop ended an earlier session (Ctrl-C, `meshrl stop`); this one continues the run.
            state.stopping = False
            state.stop_session = ""
            state.stop_version, state.stop_weights = 0, {}
            with ledger.transaction():
                ledger.save_state(state.to_json())
        self._s = state
        for lease in snap.active_leases:
            self._leases[lease.lease_id] = lease
            heapq.heappush(self._deadlines, (lease.deadline, lease.seq, lease.lease_id))
        self._expired = dict(snap.expired_leases)
        self._refused = set(snap.refused_lease_ids)
        self._submitted = set(snap.submitted_lease_ids)
        for seq, _reason in snap.retry:
            self._retry[seq] = None
        for g in snap.queued:
            assert g.payload is not None, f"queued group {g.group_id} lost its payload"
            self._queue[g.group_id] = _Queued(g.group_id, g.lease_id, g.seq, g.min_version, g.qpos, g.payload)
        for g in snap.delivered:
            self._delivered[g.lease_id] = _Delivered(
                g.group_id, g.lease_id, g.seq, g.min_version, g.step, g.staleness, g.qpos, g.payload
            )
            self._ahead += int(self._delivered[g.lease_id].train_version > state.policy_version)
        self._next_group_id = snap.max_group_id + 1

    # ---- derived numbers -------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._s.policy_version

    @property
    def max_required_samples(self) -> int:
        return max_required_samples(
            self.settings.required_samples, self._s.staleness_threshold, self.settings.trigger_parameter_sync_step
        )

    @property
    def in_flight(self) -> int:
        return len(self._leases)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def _floor(self) -> int:
        return self.in_flight + self.queued + self._ahead

    def _forget(self, d: _Delivered) -> None:
        """`d` leaves the delivered set (filtered, re-queued or checkpointed)."""
        self._ahead -= int(d.train_version > self._s.policy_version)

    def _give_back(self, n: int) -> None:
        self._s.budget_used = max(self._floor(), self._s.budget_used - n)

    @property
    def data_exhausted(self) -> bool:
        """Every prompt of the run has been issued and none waits for re-issue."""
        return self._s.cursor >= self.settings.prompts_total and not self._retry

    @property
    def exhausted(self) -> bool:
        """Nothing is left anywhere: no prompt to issue, none in flight, none queued."""
        return self.data_exhausted and not self._leases and not self._queue

    def _persist(self) -> None:
        self.ledger.save_state(self._s.to_json())

    # ---- rollout side ----------------------------------------------------------------------

    def lease(self, replica_id: str, max_groups: int, now: float) -> LeaseGrant:
        """Grant up to max_groups leases within the budget. Retried prompts go first."""
        if max_groups < 1:
            raise InvalidArgument("max_groups", "must be >= 1")
        self.expire(now)
        self._replica_seen[replica_id] = now
        if self._s.stopping:
            return LeaseGrant([], LeaseLimit.STOPPING, self._s.policy_version)
        if self._s.paused or self.failures.halted:
            return LeaseGrant([], LeaseLimit.PAUSED, self._s.policy_version)
        room = self.max_required_samples - self._s.budget_used
        granted: list[GrantedLease] = []
        rows: list[LeaseRow] = []
        from_retry: list[int] = []
        deadline = now + self.settings.lease_timeout_s
        limit = LeaseLimit.NONE
        while len(granted) < max_groups:
            if room <= 0:
                limit = LeaseLimit.STALENESS_BUDGET
                break
            if self._retry:
                seq = next(iter(self._retry))
                del self._retry[seq]
                from_retry.append(seq)
            elif self._s.cursor < self.settings.prompts_total:
                seq = self._s.cursor
                self._s.cursor += 1
                self._s.totals.prompts_issued += 1
            else:
                limit = LeaseLimit.EXHAUSTED
                break
            lease_id = uuid.uuid4().hex
            row = LeaseRow(lease_id, seq, replica_id, LeaseState.ACTIVE, now, deadline, self._s.policy_version)
            rows.append(row)
            granted.append(GrantedLease(lease_id, seq, self.prompts.get(seq), deadline, self._s.policy_version))
            room -= 1
        if rows:
            self._s.budget_used += len(rows)
            self._s.totals.leases_granted += len(rows)
            with self.ledger.transaction():
                self.ledger.insert_leases(rows)
                self.ledger.pop_retry(from_retry)
                self._persist()
            for row in rows:
                self._leases[row.lease_id] = row
                heapq.heappush(self._deadlines, (row.deadline, row.seq, row.lease_id))
        return LeaseGrant(granted, limit, self._s.policy_version)

    def renew(self, replica_id: str, lease_ids: list[str], now: float) -> tuple[list[str], list[str], float]:
        """Extend active leases; returns (renewed, lost, new deadline)."""
        self.expire(now)
        self._replica_seen[replica_id] = now
        deadline = now + self.settings.lease_timeout_s
        renewed = [i for i in lease_ids if i in self._leases]
        lost = [i for i in lease_ids if i not in self._leases]
        if renewed:
            with self.ledger.transaction():
                self.ledger.set_lease_deadlines((i, deadline) for i in renewed)
            for i in renewed:
                self._leases[i].deadline = deadline
                heapq.heappush(self._deadlines, (deadline, self._leases[i].seq, i))
        return renewed, lost, deadline

    def return_leases(self, replica_id: str, lease_ids: list[str], now: float) -> int:
        """Give active leases back unanswered; their prompts go to the head of the retry queue
        order (FIFO among retries). Unknown or finished lease ids are ignored (idempotent), so a
        return that arrives after the lease's submit changes nothing. A returned lease is then
        treated like an expired one: a submit that arrives after the return is answered by submit."""
        self._replica_seen[replica_id] = now
        rows = [self._leases.pop(i) for i in dict.fromkeys(lease_ids) if i in self._leases]
        if not rows:
            return 0
        for r in rows:
            self._retry[r.seq] = None
            self._expired[r.lease_id] = r.seq
        self._s.totals.leases_returned += len(rows)
        self._give_back(len(rows))
        with self.ledger.transaction():
            self.ledger.set_lease_state([r.lease_id for r in rows], LeaseState.RETURNED)
            self.ledger.push_retry([r.seq for r in rows], RetryReason.RETURNED)
            self._persist()
        return len(rows)

    def expire(self, now: float) -> int:
        """Expire leases whose deadline passed, and those of silent replicas; their prompts go to
        the retry queue."""
        self._expire_silent(now)
        expired: list[LeaseRow] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, lease_id = heapq.heappop(self._deadlines)
            lease = self._leases.get(lease_id)
            if lease is None or lease.deadline != deadline:
                continue  # already finished, or renewed (a newer heap entry exists)
            del self._leases[lease_id]
            expired.append(lease)
        if not expired:
            return 0
        for r in expired:
            self._retry[r.seq] = None
            self._expired[r.lease_id] = r.seq
        self._s.totals.leases_expired += len(expired)
        self._give_back(len(expired))
        with self.ledger.transaction():
            self.ledger.set_lease_state([r.lease_id for r in expired], LeaseState.EXPIRED)
            self.ledger.push_retry([r.seq for r in expired], RetryReason.EXPIRED)
            self._persist()
        return len(expired)

    def _expire_silent(self, now: float) -> None:
        """Leases of replicas silent for replica_ttl_s (liveness.py) get `now` as their deadline,
        so the expire() that called this re-queues them in its transaction; their prompts stop
        counting against the staleness budget there (expire gives their units back)."""
        silent = self._liveness.silent(now, lambda: {lease.replica_id for lease in self._leases.values()})
        if not silent:
            return
        lost: dict[str, list[LeaseRow]] = {}
        for lease in self._leases.values():
            if lease.replica_id in silent:
                lost.setdefault(lease.replica_id, []).append(lease)
        for replica_id, leases in lost.items():
            for lease in leases:
                lease.deadline = now
                heapq.heappush(self._deadlines, (now, lease.seq, lease.lease_id))
            self._s.totals.leases_replica_lost += len(leases)
            log.warning("replica_lost", replica_id=replica_id, leases=len(leases),
                        silent_s=round(now - self._replica_seen[replica_id], 1),
                        hint="its leases are re-issued now (coordinator.replica_ttl_s)")

    def report_failure(self, replica_id: str, error: str, groups: int, now: float) -> bool:
        """A replica says `groups` of its groups failed with `error` (ReturnLeases `error`; the
        leases themselves are returned by return_leases). True when this halts leasing
        (coordinator.max_consecutive_failures, failures.py)."""
        self._replica_seen[replica_id] = now
        halted = self.failures.failed(replica_id, error, max(1, groups), now)
        if halted:
            log.error("leasing_halted", reason=self.failures.halted_reason,
                      hint="fix the cause, then `meshrl resume` (or `meshrl train --resume RUN_DIR`)")
        return halted

    def submit(self, replica_id: str, groups: list[GroupIn], now: float) -> list[SubmitStatus]:
        """Record finished groups; idempotent by lease id. All-or-nothing validation: an unknown
        lease id or a group that does not match its lease fails the call before anything changes.
        A group for an expired or returned lease (a return and a submit that crossed) is accepted
        when its prompt was not re-issued yet; once refused (EXPIRED), that lease stays refused, so
        a retried request gets the same answer."""
        self.expire(now)
        self._replica_seen[replica_id] = now
        seen: set[str] = set()
        for i, g in enumerate(groups):
            where = f"groups[{i}]"
            if g.lease_id in seen:
                raise InvalidArgument(f"{where}.lease_id", f"lease {g.lease_id} appears twice in one request")
            seen.add(g.lease_id)
            lease = self._leases.get(g.lease_id)
            known_seq = lease.seq if lease is not None else self._expired.get(g.lease_id)
            if known_seq is None and g.lease_id not in self._submitted and g.lease_id not in self._refused:
                raise NotFound(f"{where}.lease_id: unknown lease {g.lease_id!r} (never granted by run {self._s.run_id})")
            if known_seq is not None and known_seq != g.seq:
                raise InvalidArgument(
                    f"{where}.prompt.prompt_seq", f"lease {g.lease_id} is for prompt {known_seq}, not {g.seq}"
                )
            if g.max_version > self._s.policy_version:
                raise InvalidArgument(
                    f"{where}.responses.versions",
                    f"token version {g.max_version} is newer than the current policy version {self._s.policy_version}",
                )
            if g.min_version < 0 or g.min_version > g.max_version:
                raise InvalidArgument(f"{where}.responses.versions", "versions must be >= 0")
        statuses: list[SubmitStatus] = []
        accepted: list[GroupRow] = []
        late_seqs: list[int] = []
        refused: list[str] = []
        for g in groups:
            if g.lease_id in self._submitted:
                statuses.append(SubmitStatus.DUPLICATE)
                self._s.totals.duplicates += 1
                continue
            if g.lease_id in self._refused:
                statuses.append(SubmitStatus.EXPIRED)
                continue
            if g.lease_id in self._leases:
                del self._leases[g.lease_id]
            else:  # expired or returned: accept only if the prompt still waits for re-issue
                seq = self._expired[g.lease_id]
                if seq not in self._retry:
                    statuses.append(SubmitStatus.EXPIRED)
                    self._s.totals.rejected_expired += 1
                    refused.append(g.lease_id)
                    continue
                del self._retry[seq]
                del self._expired[g.lease_id]
                late_seqs.append(seq)
                self._s.totals.late_accepted += 1
                # it left the budget when it expired or was returned; it is outstanding work again
                self._s.budget_used += 1
            row = GroupRow(
                group_id=self._next_group_id, lease_id=g.lease_id, seq=g.seq, state=GroupState.QUEUED,
                min_version=g.min_version, max_version=g.max_version, step=-1, staleness=-1,
                qpos=self._s.next_qpos, payload=g.payload,
            )
            self._next_group_id += 1
            self._s.next_qpos += 1
            accepted.append(row)
            statuses.append(SubmitStatus.ACCEPTED)
        if accepted or statuses:
            self._s.totals.submitted += len(accepted)
            with self.ledger.transaction():
                self.ledger.insert_groups(accepted)
                self.ledger.set_lease_state([r.lease_id for r in accepted], LeaseState.SUBMITTED)
                self.ledger.set_lease_state(refused, LeaseState.REFUSED)
                self.ledger.pop_retry(late_seqs)
                self._persist()
        for lease_id in refused:
            del self._expired[lease_id]
            self._refused.add(lease_id)
        if accepted:
            self.failures.succeeded()
        for row in accepted:
            self._submitted.add(row.lease_id)
            self._expired.pop(row.lease_id, None)
            assert row.payload is not None
            self._queue[row.group_id] = _Queued(row.group_id, row.lease_id, row.seq, row.min_version, row.qpos, row.payload)
        return statuses

    # ---- trainer side ----------------------------------------------------------------------

    def fetch(
        self, trainer_id: str, step: int, max_groups: int, now: float, filtered: list[str] | None = None,
        train_version: int | None = None,
    ) -> Batch:
        """Deliver up to max_groups queued groups in order. Groups staler than
        max_staleness_versions are re-queued as prompts (counted `regenerated`). `filtered` names
        previously delivered groups the trainer dropped untrained (DAPO dynamic sampling).

        `train_version`: the version the trainer will train these groups at (default: the current
        one). A trainer that fetches while it still trains and publishes asks for the next
        version; staleness is measured against it, and until that version is committed the groups
        count against the budget as if still queued, so fetching ahead lets no rollout run further
        ahead than fetching after the commit would."""
        if max_groups < 1:
            raise InvalidArgument("num_groups", "must be >= 1")
        current = self._s.policy_version
        version = self.check_train_version(train_version)
        self.expire(now)
        unknown = [i for i in (filtered or []) if i not in self._submitted]
        if unknown:
            raise NotFound(f"filtered_lease_ids: {unknown[0]!r} was never submitted")
        filtered_rows = [self._delivered.pop(i) for i in dict.fromkeys(filtered or []) if i in self._delivered]
        for f in filtered_rows:
            self._forget(f)
        self._s.trainer_step = max(self._s.trainer_step, step)
        delivered: list[DeliveredGroup] = []
        delivered_rows: list[_Delivered] = []
        stale: list[_Queued] = []
        eta = self.settings.max_staleness_versions
        while self._queue and len(delivered) < max_groups and not self._s.paused:
            _, q = self._queue.popitem(last=False)
            staleness = version - q.min_version
            if eta is not None and staleness > eta:
                stale.append(q)
                continue
            delivered.append(DeliveredGroup(q.lease_id, q.seq, staleness, q.payload))
            keep = self.settings.keep_delivered_payloads
            delivered_rows.append(
                _Delivered(q.group_id, q.lease_id, q.seq, q.min_version, step, staleness, q.qpos, q.payload if keep else None)
            )
        if version > current:
            self._ahead += len(delivered_rows)
        for d in delivered_rows:
            self._delivered[d.lease_id] = d
            self._s.histogram[d.staleness] = self._s.histogram.get(d.staleness, 0) + 1
        for f in filtered_rows:
            self._s.histogram[f.staleness] -= 1
        for q in stale:
            self._retry[q.seq] = None
        self._s.totals.consumed += len(delivered_rows) - len(filtered_rows)
        self._s.totals.filtered += len(filtered_rows)
        self._s.totals.regenerated += len(stale)
        self._give_back(len(filtered_rows) + len(stale))
        if delivered_rows or filtered_rows or stale or step != self._s.trainer_step:
            with self.ledger.transaction():
                self.ledger.deliver_groups(
                    (d.group_id, d.step, d.staleness, d.payload is not None) for d in delivered_rows
                )
                self.ledger.set_group_state([f.group_id for f in filtered_rows], GroupState.FILTERED, drop_payload=True)
                self.ledger.set_group_state([q.group_id for q in stale], GroupState.REJECTED_STALE, drop_payload=True)
                self.ledger.push_retry([q.seq for q in stale], RetryReason.STALE)
                self._persist()
        return Batch(
            groups=delivered,
            policy_version=self._s.policy_version,
            exhausted=self.exhausted,
            checkpoint_requested=self._s.checkpoint_requested,
            stop_requested=self._s.stopping,
            regenerated=len(stale),
        )

    def check_train_version(self, train_version: int | None) -> int:
        """FetchBatch's train_version, or the current version when unset."""
        current = self._s.policy_version
        if train_version is None:
            return current
        if not current <= train_version <= current + 1:
            raise FailedPrecondition(
                f"train_version {train_version}: a trainer fetches for the current version ({current}) or the "
                f"next ({current + 1}) only; commit version {train_version - 1} before fetching groups to train "
                f"at {train_version}"
            )
        return train_version

    def commit_version(self, version: int, weights: dict[str, Any]) -> tuple[int, int]:
        """Make `version` current (must be current + 1; re-committing the current version with the
        same weights is a no-op) and reset the budget to in_flight + queued (+ groups fetched ahead
        to train at it)."""
        cur = self._s.policy_version
        if version == cur and weights == self._s.weights:
            return cur, self._s.budget_used
        if version != cur + 1:
            raise FailedPrecondition(f"weights.policy_version must be {cur + 1} (current is {cur}), got {version}")
        self._s.policy_version = version
        self._s.weights = dict(weights)
        # Groups fetched ahead to train at this version stay counted, as they would have been
        # still queued had the trainer fetched after this commit; from now on they are current.
        self._s.budget_used = self._floor()
        self._ahead = 0
        with self.ledger.transaction():
            self._persist()
        return version, self._s.budget_used

    def report_checkpoint(self, step: int, version: int, path: str) -> None:
        """Groups delivered at or before `step` are now part of a durable checkpoint."""
        if step < self._s.last_checkpoint_step:
            raise FailedPrecondition(f"step {step} is older than the last checkpoint step {self._s.last_checkpoint_step}")
        for lease_id in [k for k, d in self._delivered.items() if d.step <= step]:
            self._forget(self._delivered.pop(lease_id))
        self._s.last_checkpoint_step = step
        self._s.last_checkpoint_path = path
        self._s.checkpoint_requested = False
        with self.ledger.transaction():
            self.ledger.consume_through_step(step)
            self._persist()

    def resume_trainer(self, checkpoint_step: int) -> int:
        """A trainer restarted from `checkpoint_step`: groups delivered after it go back to the
        head of the queue in their original order (prompts of groups whose payload was dropped go
        back to the retry queue). Returns how many were returned."""
        back = sorted((d for d in self._delivered.values() if d.step > checkpoint_step), key=lambda d: d.qpos)
        with_payload = [d for d in back if d.payload is not None]
        without = [d for d in back if d.payload is None]
        moves: list[tuple[int, int]] = []
        head: OrderedDict[int, _Queued] = OrderedDict()
        base = self._s.min_qpos - len(with_payload)
        for i, d in enumerate(with_payload):
            assert d.payload is not None
            qpos = base + i
            head[d.group_id] = _Queued(d.group_id, d.lease_id, d.seq, d.min_version, qpos, d.payload)
            moves.append((d.group_id, qpos))
        self._s.min_qpos = min(self._s.min_qpos, base)
        for d in back:
            self._forget(self._delivered.pop(d.lease_id))
            self._s.histogram[d.staleness] -= 1
        for d in without:
            self._retry[d.seq] = None
        self._s.totals.consumed -= len(back)
        self._s.totals.regenerated += len(without)
        self._s.budget_used += len(with_payload)  # outstanding work again
        self._s.trainer_step = checkpoint_step
        head.update(self._queue)
        self._queue = head
        with self.ledger.transaction():
            self.ledger.requeue_groups(moves)
            self.ledger.set_group_state([d.group_id for d in without], GroupState.REJECTED_STALE)
            self.ledger.push_retry([d.seq for d in without], RetryReason.TRAINER_RESUME)
            self._persist()
        return len(back)

    # ---- control ---------------------------------------------------------------------------

    def set_paused(self, paused: bool) -> None:
        """Pause or resume leasing; resuming also lifts a halt on failures."""
        self._s.paused = paused
        if not paused:
            self.failures.clear()
        with self.ledger.transaction():
            self._persist()

    def set_staleness(self, threshold: float) -> int:
        if not threshold >= 0:
            raise InvalidArgument("staleness_threshold", f"must be >= 0, got {threshold}")
        self._s.staleness_threshold = float(threshold)
        with self.ledger.transaction():
            self._persist()
        return self.max_required_samples

    def request_checkpoint(self) -> None:
        self._s.checkpoint_requested = True
        with self.ledger.transaction():
            self._persist()

    def stop(self) -> None:
        if not self._s.stopping:
            self._s.stop_version, self._s.stop_weights = self._s.policy_version, dict(self._s.weights)
        self._s.stopping = True
        self._s.stop_session = self.settings.session
        with self.ledger.transaction():
            self._persist()

    @property
    def paused(self) -> bool:
        return self._s.paused

    @property
    def stopping(self) -> bool:
        return self._s.stopping

    @property
    def weights(self) -> dict[str, Any]:
        return dict(self._s.weights)

    def announced(self) -> tuple[int, dict[str, Any]]:
        """The version rollouts are told of, and its weights: the newest, or once the run is
        stopping the one current at the Stop (a version committed later reaches no rollout:
        CommitVersionResponse.stopping)."""
        if self._s.stopping:
            return self._s.stop_version, dict(self._s.stop_weights)
        return self._s.policy_version, dict(self._s.weights)

    # ---- inspection ------------------------------------------------------------------------

    def status(self, now: float) -> Status:
        self.expire(now)
        window = self.settings.lease_timeout_s
        return Status(
            run_id=self._s.run_id,
            policy_version=self._s.policy_version,
            paused=self._s.paused,
            stopping=self._s.stopping,
            staleness_threshold=self._s.staleness_threshold,
            required_samples=self.settings.required_samples,
            max_required_samples=self.max_required_samples,
            budget_used=self._s.budget_used,
            max_staleness_versions=self.settings.max_staleness_versions,
            prompts_total=self.settings.prompts_total,
            in_flight=self.in_flight,
            queued=self.queued,
            retry_pending=len(self._retry),
            delivered_uncheckpointed=len(self._delivered),
            totals=Totals(**self._s.totals.__dict__),
            histogram={k: v for k, v in sorted(self._s.histogram.items()) if v},
            trainer_step=self._s.trainer_step,
            last_checkpoint_step=self._s.last_checkpoint_step,
            checkpoint_requested=self._s.checkpoint_requested,
            active_replicas=sorted(r for r, t in self._replica_seen.items() if now - t <= window),
            weights=dict(self._s.weights),
            failures=self.failures.reports(),
            halted_reason=self.failures.halted_reason,
        )

    def audit(self) -> dict[str, Any]:
        """Check from the ledger that every issued prompt is in exactly one place. Returns a report
        with `lost` and `duplicated` sequence numbers (both empty when the books balance)."""
        where = self.ledger.live_seqs()
        counts: dict[int, int] = {}
        for seqs in where.values():
            for s in seqs:
                counts[s] = counts.get(s, 0) + 1
        issued = range(self._s.cursor)
        lost = [s for s in issued if s not in counts]
        duplicated = sorted(s for s, n in counts.items() if n > 1)
        return {
            "issued": self._s.cursor,
            "in_flight": len(where["in_flight"]),
            "retry": len(where["retry"]),
            "groups": len(where["groups"]),
            "lost": lost,
            "duplicated": duplicated,
            "balanced": not lost and not duplicated,
        }
