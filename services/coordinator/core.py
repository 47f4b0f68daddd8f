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
    (expired, returned, stale, filtered) gives its unit back while the count holds it, never below
    in_flight + queued.
"""

from __future__ import annotations

import base64
import dataclasses
import heapq
import math
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from services.common.config.async_training import MAX_STALENESS_THRESHOLD
from services.common.config.root import max_required_samples
from services.common.data import PromptRecord, PromptStream
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.common.limits import RecentlySeen
from services.common.logging import get_logger

from .failures import MAX_ERROR_CHARS, FailureLog, FailureReport
from .ledger import GroupRow, GroupState, LeaseRow, LeaseState, Ledger, RetryReason
from .liveness import ReplicaLiveness

log = get_logger(__name__)

MAX_REPLICAS_SEEN = 4096
COMPACT_SLACK = 1024
"""Stale expiry-heap entries allowed beyond twice the live leases before the heap is rebuilt."""
INT64_MAX = (1 << 63) - 1
"""The ledger (SQLite) stores integers as int64: larger request values are refused up front."""
FETCH_REPLY_OVERHEAD = 128
"""Bytes of a FetchBatchResponse besides its groups (scalars, the staleness field's header)."""
FETCH_GROUP_OVERHEAD = 16
"""Bytes per delivered group besides its payload: its field tag and length, its staleness entry."""


def check_int64(value: int, field: str) -> int:
    """A request integer the ledger stores: within [0, 2^63 - 1]."""
    if not 0 <= value <= INT64_MAX:
        raise InvalidArgument(field, f"must be in [0, 2^63 - 1], got {value}")
    return value


def check_staleness_threshold(value: float, field: str = "staleness_threshold") -> float:
    if not (math.isfinite(value) and 0 <= value <= MAX_STALENESS_THRESHOLD):
        raise InvalidArgument(field, f"must be a finite number in [0, {MAX_STALENESS_THRESHOLD:g}], got {value}")
    return value


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
    max_prompt_failures: int | None = None
    """Failures of one prompt, each on a replica that had a group accepted since its own last
    failure, that set it aside (see return_leases); None: never."""

    data_digest: str = ""
    """The prompt stream's identity (data.stream_digest: its rows in order, shuffle, seed): a
    ledger's prompt positions mean these prompts only. Empty: not checked."""

    def fingerprint(self) -> dict[str, Any]:
        """Facts a ledger must agree with to be continued by this config."""
        facts: dict[str, Any] = {"prompts_total": self.prompts_total, "required_samples": self.required_samples}
        if self.data_digest:
            facts["data"] = self.data_digest
        return facts


class LeaseLimit(Enum):
    NONE = "none"
    STALENESS_BUDGET = "staleness_budget"
    PAUSED = "paused"
    EXHAUSTED = "exhausted"
    STOPPING = "stopping"
    MESSAGE_SIZE = "message_size"


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
    # whether the ledger keeps its payload (for ResumeTrainer to queue it again); the bytes stay in
    # the ledger only: held here too, a run without checkpoints grew by every group it trained
    has_payload: bool

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
    prompts_set_aside: int = 0
    """Prompts that failed coordinator.max_prompt_failures times: never leased again."""


@dataclass
class _State:
    run_id: str
    fingerprint: dict[str, Any]
    policy_version: int = 0
    weights: bytes = b""
    """The committed version's WeightsRef in wire form (opaque here; sent to rollouts as is)."""
    cursor: int = 0
    budget_used: int = 0
    staleness_threshold: float = 0.0
    config_staleness_threshold: float | None = None
    """The config's staleness_threshold when this run last opened the ledger (None: a ledger from
    before it was kept): a config that says otherwise at a restart was changed on purpose."""
    paused: bool = False
    stopping: bool = False
    stop_session: str = ""
    stop_version: int = 0
    """policy_version at the Stop: the last version rollouts are told of (WatchVersions)."""
    stop_weights: bytes = b""
    halted_reason: str = ""
    """The halt on failures in a row (failures.py), kept like a Stop: a restarted replica of the
    session that halted stays halted (else it leased again into the unfixed cause, and the
    watchdog never read the reason); a later session, or Resume, lifts it."""
    halt_session: str = ""
    checkpoint_requested: bool = False
    trainer_step: int = 0
    last_checkpoint_step: int = -1
    last_checkpoint_path: str = ""
    next_qpos: int = 0
    min_qpos: int = 0
    totals: Totals = field(default_factory=Totals)
    histogram: dict[int, int] = field(default_factory=dict)

    def copy(self) -> _State:
        """An independent copy: methods change a copy and make it current only once the ledger has
        it, so a failed write leaves memory as it was."""
        return dataclasses.replace(
            self, fingerprint=dict(self.fingerprint),
            totals=dataclasses.replace(self.totals), histogram=dict(self.histogram),
        )

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["totals"] = dict(self.totals.__dict__)
        d["histogram"] = {str(k): v for k, v in self.histogram.items()}
        d["weights"] = base64.b64encode(self.weights).decode()
        d["stop_weights"] = base64.b64encode(self.stop_weights).decode()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], ledger_path: str = "") -> _State:
        """LEDGER_PATH names the file in the error. A key missing is a ledger from before its field
        (the default applies); a key unknown is one from a newer meshrl, refused like a newer
        schema (Ledger._open): ignored, its meaning (a halt, a count) would be lost at the next
        save_state, which writes the whole row, and the newer meshrl could not continue the run."""
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        unknown += sorted(f"totals.{k}" for k in set(d.get("totals", {})) - {f.name for f in dataclasses.fields(Totals)})
        if unknown:
            raise FailedPrecondition(
                f"ledger {ledger_path} was written by a newer meshrl (its run state holds {unknown}, which this "
                "one does not know): continue the run with that meshrl, or start a new one on a new "
                "coordinator.ledger_path"
            )
        d = dict(d)
        d["totals"] = Totals(**d["totals"])
        d["histogram"] = {int(k): v for k, v in d["histogram"].items()}
        for key in ("weights", "stop_weights"):
            d[key] = _weights_bytes(d.get(key, ""))
        return cls(**d)


def _weights_bytes(stored: str | dict[str, Any]) -> bytes:
    """A stored WeightsRef: base64 of its wire form, or the dict a ledger written before it held."""
    if isinstance(stored, str):
        return base64.b64decode(stored)
    if not stored:
        return b""
    from meshrl.v1 import common_pb2

    return common_pb2.WeightsRef(
        policy_version=int(stored.get("policy_version", 0)),
        param_server_address=str(stored.get("param_server_address", "")),
        manifest_checksum=str(stored.get("manifest_checksum", "")),
        total_bytes=int(stored.get("total_bytes", 0)),
    ).SerializeToString()


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
    weights: bytes
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
        # Leases that ended (submitted, expired, returned, refused) are looked up in the ledger
        # (Ledger.lease_fates) when a late or repeated answer names one: memory holds only what is
        # live, so it does not grow with the run nor is every lease read back at a restart.
        self._retry: OrderedDict[int, None] = OrderedDict()
        self._queue: OrderedDict[int, _Queued] = OrderedDict()
        self._delivered: dict[str, _Delivered] = {}
        # Delivered groups fetched ahead (to train at the next version): they count against the
        # budget like queued ones until that version is committed.
        self._ahead = 0
        self._next_group_id = 1
        # Replica ids come from callers: bounded in number and age (GetStatus lists them).
        self._replica_seen: dict[str, float] = RecentlySeen(MAX_REPLICAS_SEEN, settings.lease_timeout_s)
        self._liveness = ReplicaLiveness(self._replica_seen, settings.replica_ttl_s)
        self._silent_leases: set[str] = set()  # leases due now because their replica went silent
        self.failures = FailureLog(settings.max_consecutive_failures)
        # seq -> failures counted, for prompts with no group accepted yet; replica -> whether a
        # group of it was accepted since its last failure (bounded like _replica_seen): see
        # return_leases
        self._prompt_failures: dict[int, int] = {}
        self._replica_clean: OrderedDict[str, bool] = OrderedDict()
        self._set_aside: set[int] = set()
        snap = ledger.load()
        if snap.state is None:
            self._state = _State(
                run_id=settings.run_id or uuid.uuid4().hex[:12],
                fingerprint=settings.fingerprint(),
                staleness_threshold=settings.staleness_threshold,
                config_staleness_threshold=settings.staleness_threshold,
            )
            with ledger.transaction():
                ledger.save_state(self._state.to_json())
            return
        state = _State.from_json(snap.state, ledger.path)
        want = settings.fingerprint()
        # a ledger written before the data digest was kept takes this config's (unchecked, once)
        upgraded = "data" in want and "data" not in state.fingerprint
        have = {**state.fingerprint, "data": want["data"]} if upgraded else state.fingerprint
        if have.get("data") != want.get("data"):
            raise FailedPrecondition(
                f"ledger {ledger.path} belongs to a run over other prompt data (digest {str(have.get('data'))[:12]}, "
                f"this config's {str(want.get('data'))[:12]}): the files, their order or content, data.shuffle or "
                "data.seed differ, and the ledger's prompt positions would name other prompts (some issued twice in "
                "the epoch, some never); use the run's data settings, or a new coordinator.ledger_path"
            )
        if have != want:
            raise FailedPrecondition(
                f"ledger {ledger.path} belongs to a run with {state.fingerprint}, but this config gives "
                f"{want}; use the same data and batch settings, or a new coordinator.ledger_path"
            )
        repaired = upgraded
        if upgraded:
            state.fingerprint = want
        if state.stopping and state.stop_session != settings.session:
            # The Stop ended an earlier session (Ctrl-C, `meshrl stop`); this one continues the run.
            state.stopping = False
            state.stop_session = ""
            state.stop_version, state.stop_weights = 0, b""
            repaired = True
        if state.halted_reason and state.halt_session != settings.session:
            # `meshrl train --resume`: the cause may have been fixed (failures.py); if not, the run
            # halts again after the same number of failures.
            state.halted_reason, state.halt_session = "", ""
            repaired = True
        if state.config_staleness_threshold != settings.staleness_threshold:
            # The ledger's threshold wins over the same config (one set live by SetStaleness survives
            # a restart), not over a changed one: `meshrl train --resume RUN_DIR
            # async_training.staleness_threshold=...` or `--mode sync` went on at the first run's.
            if state.config_staleness_threshold is not None:
                log.info("staleness_threshold_from_config", staleness_threshold=settings.staleness_threshold,
                         was=state.staleness_threshold, note="the config's value changed since the ledger's run")
                state.staleness_threshold = settings.staleness_threshold
            state.config_staleness_threshold = settings.staleness_threshold
            repaired = True
        if not (math.isfinite(state.staleness_threshold) and 0 <= state.staleness_threshold <= MAX_STALENESS_THRESHOLD):
            # Written by a coordinator that did not range-check SetStaleness: it would fail every
            # budget computation from here on, so the config's value applies again.
            state.staleness_threshold = settings.staleness_threshold
            repaired = True
        if repaired:
            with ledger.transaction():
                ledger.save_state(state.to_json())
        self._state = state
        for lease in snap.active_leases:
            self._leases[lease.lease_id] = lease
            self._push_deadline(lease.deadline, lease.seq, lease.lease_id)
        for seq, _reason in snap.retry:
            self._retry[seq] = None
        for g in snap.queued:
            assert g.payload is not None, f"queued group {g.group_id} lost its payload"
            self._queue[g.group_id] = _Queued(g.group_id, g.lease_id, g.seq, g.min_version, g.qpos, g.payload)
        for g in snap.delivered:
            self._delivered[g.lease_id] = _Delivered(
                g.group_id, g.lease_id, g.seq, g.min_version, g.step, g.staleness, g.qpos, g.payload is not None
            )
            self._ahead += int(self._delivered[g.lease_id].train_version > state.policy_version)
        self._next_group_id = snap.max_group_id + 1
        self._prompt_failures = dict(snap.prompt_failures)
        self._set_aside = set(snap.set_aside)
        if state.halted_reason:
            self.failures.restore(state.halted_reason)

    # ---- derived numbers -------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._state.policy_version

    @property
    def max_required_samples(self) -> int:
        return max_required_samples(
            self.settings.required_samples, self._state.staleness_threshold, self.settings.trigger_parameter_sync_step
        )

    @property
    def in_flight(self) -> int:
        return len(self._leases)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def _floor(self) -> int:
        return self.in_flight + self.queued + self._ahead

    @property
    def data_exhausted(self) -> bool:
        """Every prompt of the run has been issued and none waits for re-issue."""
        return self._state.cursor >= self.settings.prompts_total and not self._retry

    @property
    def exhausted(self) -> bool:
        """Nothing is left anywhere: no prompt to issue, none in flight, none queued."""
        return self.data_exhausted and not self._leases and not self._queue

    def _save(self, state: _State) -> None:
        """Persist `state` alone, then make it current."""
        with self.ledger.transaction():
            self.ledger.save_state(state.to_json())
        self._state = state

    # ---- rollout side ----------------------------------------------------------------------

    def lease(
        self, replica_id: str, max_groups: int, now: float, *, max_reply_bytes: int | None = None,
        lease_bytes: Callable[[GrantedLease], int] | None = None,
    ) -> LeaseGrant:
        """Grant up to max_groups leases within the budget. Retried prompts go first.

        With `max_reply_bytes` (and `lease_bytes`, a lease's size on the wire) grants stop before
        the reply would pass that size (limit MESSAGE_SIZE): the rest stays for the next call. A
        prompt larger than the whole reply fails the call before anything changes."""
        if max_groups < 1:
            raise InvalidArgument("max_groups", "must be >= 1")
        self.expire(now)
        if self._state.stopping or self._state.paused or self.failures.halted:
            self._replica_seen[replica_id] = now
            limit = LeaseLimit.STOPPING if self._state.stopping else LeaseLimit.PAUSED
            return LeaseGrant([], limit, self._state.policy_version)
        s = self._state.copy()
        room = self.max_required_samples - s.budget_used
        retry = iter(self._retry)
        granted: list[GrantedLease] = []
        rows: list[LeaseRow] = []
        from_retry: list[int] = []
        deadline = now + self.settings.lease_timeout_s
        limit = LeaseLimit.NONE
        reply_bytes = 0
        while len(granted) < max_groups:
            if room <= 0:
                limit = LeaseLimit.STALENESS_BUDGET
                break
            seq = next(retry, None)
            fresh = seq is None
            if seq is None:
                if s.cursor >= self.settings.prompts_total:
                    limit = LeaseLimit.EXHAUSTED
                    break
                seq = s.cursor
            lease = GrantedLease(uuid.uuid4().hex, seq, self.prompts.get(seq), deadline, s.policy_version)
            if max_reply_bytes is not None and lease_bytes is not None:
                size = lease_bytes(lease)
                if reply_bytes + size > max_reply_bytes:
                    if not granted:
                        raise ResourceExhausted(
                            f"prompt {seq} takes {size} bytes on the wire, more than the reply limit of "
                            f"{max_reply_bytes} bytes; raise coordinator.max_message_mb (and the rollout's "
                            "client limit with it) or shorten the prompt"
                        )
                    limit = LeaseLimit.MESSAGE_SIZE
                    break
                reply_bytes += size
            if fresh:
                s.cursor += 1
                s.totals.prompts_issued += 1
            else:
                from_retry.append(seq)
            rows.append(LeaseRow(lease.lease_id, seq, replica_id, LeaseState.ACTIVE, now, deadline, s.policy_version))
            granted.append(lease)
            room -= 1
        if rows:
            s.budget_used += len(rows)
            s.totals.leases_granted += len(rows)
            with self.ledger.transaction():
                self.ledger.insert_leases(rows)
                self.ledger.pop_retry(from_retry)
                self.ledger.save_state(s.to_json())
            self._state = s
            for seq in from_retry:
                del self._retry[seq]
            for row in rows:
                self._leases[row.lease_id] = row
                self._push_deadline(row.deadline, row.seq, row.lease_id)
        self._replica_seen[replica_id] = now
        return LeaseGrant(granted, limit, self._state.policy_version)

    def renew(self, replica_id: str, lease_ids: list[str], now: float) -> tuple[list[str], list[str], float]:
        """Extend active leases; returns (renewed, lost, new deadline)."""
        self.expire(now)
        deadline = now + self.settings.lease_timeout_s
        lease_ids = list(dict.fromkeys(lease_ids))  # a repeated id renews once (one heap entry, one write)
        renewed = [i for i in lease_ids if i in self._leases]
        lost = [i for i in lease_ids if i not in self._leases]
        if renewed:
            with self.ledger.transaction():
                self.ledger.set_lease_deadlines((i, deadline) for i in renewed)
            for i in renewed:
                self._leases[i].deadline = deadline
                self._push_deadline(deadline, self._leases[i].seq, i)
        self._replica_seen[replica_id] = now
        return renewed, lost, deadline

    def return_leases(self, replica_id: str, lease_ids: list[str], now: float, error: str = "") -> int:
        """Give active leases back unanswered; their prompts go to the head of the retry queue
        order (FIFO among retries). Unknown or finished lease ids are ignored (idempotent), so a
        return that arrives after the lease's submit changes nothing. A returned lease is then
        treated like an expired one: a submit that arrives after the return is answered by submit.

        With an `error` (their groups failed) each prompt's failure is counted, but only on a
        replica that had a group accepted since its own last failure (in this process): a
        replica that fails everything (a broken engine, its endpoint down) or an outage
        that fails every replica counts once, not once per re-issue (max_consecutive_failures
        halts the run on an outage); a prompt that fails on replicas that otherwise work is the
        prompt's own trouble (a template it breaks, data a tool cannot take). At
        coordinator.max_prompt_failures it is set aside: never leased again (it was re-issued at
        once, every time, for as long as the run lasted), counted (totals.prompts_set_aside),
        logged, and accounted for by the audit. Where groups fail at random (a flaky endpoint
        failing a share p of them), about p**max_prompt_failures of the prompts are set aside."""
        rows = [self._leases[i] for i in dict.fromkeys(lease_ids) if i in self._leases]
        if not rows:
            self._replica_seen[replica_id] = now
            return 0
        s = self._state.copy()
        s.totals.leases_returned += len(rows)
        s.budget_used = max(self._floor() - len(rows), s.budget_used - len(rows))
        counted: dict[int, int] = {}
        aside: dict[int, int] = {}
        limit = self.settings.max_prompt_failures
        counts = bool(error) and limit is not None and self._replica_clean.get(replica_id, False)
        if counts:
            for r in rows:
                counted[r.seq] = self._prompt_failures.get(r.seq, 0) + 1
                if limit is not None and counted[r.seq] >= limit:
                    aside[r.seq] = counted[r.seq]
        s.totals.prompts_set_aside += len(aside)
        why = " ".join(error.split())[:MAX_ERROR_CHARS]
        with self.ledger.transaction():
            self.ledger.set_lease_state([r.lease_id for r in rows], LeaseState.RETURNED)
            self.ledger.push_retry([r.seq for r in rows if r.seq not in aside], RetryReason.RETURNED)
            self.ledger.save_prompt_failures((seq, n, why) for seq, n in counted.items() if seq not in aside)
            self.ledger.drop_prompt_failures(aside)  # the set_aside row keeps the count
            self.ledger.set_aside((seq, n, why) for seq, n in aside.items())
            self.ledger.save_state(s.to_json())
        self._state = s
        self._prompt_failures.update((seq, n) for seq, n in counted.items() if seq not in aside)
        for seq in aside:
            self._prompt_failures.pop(seq, None)
        self._set_aside.update(aside)
        if error:
            self._mark_replica(replica_id, clean=False)
        self._requeue_leases(rows, aside=set(aside))
        self._replica_seen[replica_id] = now
        for seq, n in aside.items():
            log.warning("prompt_set_aside", seq=seq, failures=n, error=why,
                        hint="its groups kept failing while others went through; it is not leased again "
                             "(coordinator.max_prompt_failures)")
        return len(rows)

    def _mark_replica(self, replica_id: str, *, clean: bool) -> None:
        self._replica_clean[replica_id] = clean
        self._replica_clean.move_to_end(replica_id)
        while len(self._replica_clean) > MAX_REPLICAS_SEEN:
            self._replica_clean.popitem(last=False)

    def _requeue_leases(self, rows: list[LeaseRow], aside: Collection[int] = ()) -> None:
        """Leases that ended unanswered (expired, returned): their prompts wait for re-issue, but
        those set `aside`."""
        for r in rows:
            del self._leases[r.lease_id]
            if r.seq not in aside:
                self._retry[r.seq] = None

    def _push_deadline(self, deadline: float, seq: int, lease_id: str) -> None:
        """Every renewal pushes an entry and leaves the older one to pop at its deadline, so the
        heap holds ~lease_timeout_s / renew interval entries per lease: rebuilt from the live
        leases when it outgrows them twice over (a burst of renewals, of finished leases)."""
        heapq.heappush(self._deadlines, (deadline, seq, lease_id))
        if len(self._deadlines) > 2 * len(self._leases) + COMPACT_SLACK:
            self._deadlines = [(r.deadline, r.seq, r.lease_id) for r in self._leases.values()]
            heapq.heapify(self._deadlines)

    def expire(self, now: float) -> int:
        """Expire leases whose deadline passed, and those of silent replicas; their prompts go to
        the retry queue."""
        self._expire_silent(now)
        popped: list[tuple[float, int, str]] = []
        expired: list[LeaseRow] = []
        due: set[str] = set()
        while self._deadlines and self._deadlines[0][0] <= now:
            entry = heapq.heappop(self._deadlines)
            popped.append(entry)
            lease = self._leases.get(entry[2])
            if lease is None or lease.deadline != entry[0] or entry[2] in due:
                # already finished, renewed (a newer heap entry exists), or an equal entry (a
                # renewal to the deadline it had) popped already
                continue
            due.add(entry[2])
            expired.append(lease)
        if not expired:
            return 0
        s = self._state.copy()
        s.totals.leases_expired += len(expired)
        lost = [r.lease_id for r in expired if r.lease_id in self._silent_leases]
        s.totals.leases_replica_lost += len(lost)
        s.budget_used = max(self._floor() - len(expired), s.budget_used - len(expired))
        try:
            with self.ledger.transaction():
                self.ledger.set_lease_state([r.lease_id for r in expired], LeaseState.EXPIRED)
                self.ledger.push_retry([r.seq for r in expired], RetryReason.EXPIRED)
                self.ledger.save_state(s.to_json())
        except BaseException:
            for entry in popped:
                heapq.heappush(self._deadlines, entry)
            raise
        self._state = s
        self._silent_leases.difference_update(lost)
        self._requeue_leases(expired)
        return len(expired)

    def _expire_silent(self, now: float) -> None:
        """Leases of replicas silent for replica_ttl_s (liveness.py) get `now` as their deadline,
        so the expire() that called this re-queues them in its transaction; their prompts stop
        counting against the staleness budget there (expire gives their units back). Memory only:
        if that transaction fails, the leases are simply due (and counted) at the next expire."""
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
                self._push_deadline(now, lease.seq, lease.lease_id)
                self._silent_leases.add(lease.lease_id)
            log.warning("replica_lost", replica_id=replica_id, leases=len(leases),
                        silent_s=round(now - self._liveness.heard(replica_id, now), 1),
                        hint="its leases are re-issued now (coordinator.replica_ttl_s)")

    def report_failure(self, replica_id: str, error: str, groups: int, now: float) -> bool:
        """A replica says `groups` of its groups failed with `error` (ReturnLeases `error`; the
        leases themselves are returned by return_leases). True when this halts leasing
        (coordinator.max_consecutive_failures, failures.py)."""
        self._replica_seen[replica_id] = now
        halted = self.failures.failed(replica_id, error, max(1, groups), now)
        if halted:
            s = self._state.copy()
            s.halted_reason, s.halt_session = self.failures.halted_reason, self.settings.session
            try:
                self._save(s)
            except Exception as exc:  # noqa: BLE001 -- the leases are returned already; halted in memory still
                log.warning("halt_not_persisted", error=f"{type(exc).__name__}: {exc}",
                            note="a restart of this coordinator would lease again")
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
        fates = self.ledger.lease_fates(g.lease_id for g in groups if g.lease_id not in self._leases)
        seen: set[str] = set()
        for i, g in enumerate(groups):
            where = f"groups[{i}]"
            if g.lease_id in seen:
                raise InvalidArgument(f"{where}.lease_id", f"lease {g.lease_id} appears twice in one request")
            seen.add(g.lease_id)
            lease = self._leases.get(g.lease_id)
            fate = fates.get(g.lease_id)
            if lease is None and fate is None:
                raise NotFound(f"{where}.lease_id: unknown lease {g.lease_id!r} (never granted by run {self._state.run_id})")
            # expired or returned: a late answer, for the prompt its lease was for
            ended = fate is not None and fate[0] in (LeaseState.EXPIRED, LeaseState.RETURNED)
            known_seq = lease.seq if lease is not None else (fate[1] if fate is not None and ended else None)
            if known_seq is not None and known_seq != g.seq:
                raise InvalidArgument(
                    f"{where}.prompt.prompt_seq", f"lease {g.lease_id} is for prompt {known_seq}, not {g.seq}"
                )
            if g.max_version > self._state.policy_version:
                raise InvalidArgument(
                    f"{where}.responses.versions",
                    f"token version {g.max_version} is newer than the current policy version {self._state.policy_version}",
                )
            if g.min_version < 0 or g.min_version > g.max_version:
                raise InvalidArgument(f"{where}.responses.versions", "versions must be >= 0")
        s = self._state.copy()
        statuses: list[SubmitStatus] = []
        accepted: list[GroupRow] = []
        from_active: list[str] = []
        late: dict[str, int] = {}
        refused: list[str] = []
        next_group_id = self._next_group_id
        for g in groups:
            fate = fates.get(g.lease_id)
            if fate is not None and fate[0] is LeaseState.SUBMITTED:
                statuses.append(SubmitStatus.DUPLICATE)
                s.totals.duplicates += 1
                continue
            if fate is not None and fate[0] is LeaseState.REFUSED:
                statuses.append(SubmitStatus.EXPIRED)
                continue
            if g.lease_id in self._leases:
                from_active.append(g.lease_id)
            else:  # expired or returned: accept only if the prompt still waits for re-issue
                assert fate is not None  # checked above
                seq = fate[1]
                # (two expired leases of one prompt in one request: the first one takes it)
                if seq not in self._retry or seq in late.values():
                    statuses.append(SubmitStatus.EXPIRED)
                    s.totals.rejected_expired += 1
                    refused.append(g.lease_id)
                    continue
                late[g.lease_id] = seq
                s.totals.late_accepted += 1
                # it left the budget when it expired or was returned; it is outstanding work again
                s.budget_used += 1
            accepted.append(GroupRow(
                group_id=next_group_id, lease_id=g.lease_id, seq=g.seq, state=GroupState.QUEUED,
                min_version=g.min_version, max_version=g.max_version, step=-1, staleness=-1,
                qpos=s.next_qpos, payload=g.payload,
            ))
            next_group_id += 1
            s.next_qpos += 1
            statuses.append(SubmitStatus.ACCEPTED)
        s.totals.submitted += len(accepted)
        failed_before = [r.seq for r in accepted if r.seq in self._prompt_failures]  # done failing
        with self.ledger.transaction():
            self.ledger.insert_groups(accepted)
            self.ledger.set_lease_state([r.lease_id for r in accepted], LeaseState.SUBMITTED)
            self.ledger.set_lease_state(refused, LeaseState.REFUSED)
            self.ledger.pop_retry(late.values())
            self.ledger.drop_prompt_failures(failed_before)
            self.ledger.save_state(s.to_json())
        self._state = s
        self._replica_seen[replica_id] = now
        self._next_group_id = next_group_id
        for lease_id in from_active:
            del self._leases[lease_id]
        for seq in late.values():
            del self._retry[seq]
        for seq in failed_before:
            del self._prompt_failures[seq]
        if accepted:
            self.failures.succeeded()
            self._mark_replica(replica_id, clean=True)
        for row in accepted:
            assert row.payload is not None
            self._queue[row.group_id] = _Queued(row.group_id, row.lease_id, row.seq, row.min_version, row.qpos, row.payload)
        return statuses

    # ---- trainer side ----------------------------------------------------------------------

    def fetch(
        self, trainer_id: str, step: int, max_groups: int, now: float, filtered: list[str] | None = None,
        train_version: int | None = None, max_reply_bytes: int | None = None,
    ) -> Batch:
        """Deliver up to max_groups queued groups in order. Groups staler than
        max_staleness_versions are re-queued as prompts (counted `regenerated`). `filtered` names
        previously delivered groups the trainer dropped untrained (DAPO dynamic sampling).

        `train_version`: the version the trainer will train these groups at (default: the current
        one). A trainer that fetches while it still trains and publishes asks for the next
        version; staleness is measured against it, and until that version is committed the groups
        count against the budget as if still queued, so fetching ahead lets no rollout run further
        ahead than fetching after the commit would.

        `max_reply_bytes`: delivery stops before the groups' payloads (plus their framing, see
        `FETCH_REPLY_OVERHEAD`) would pass this size; the rest stays queued for the next call. A
        group larger than the whole reply fails the call before anything changes."""
        if max_groups < 1:
            raise InvalidArgument("num_groups", "must be >= 1")
        check_int64(step, "step")
        current = self._state.policy_version
        version = self.check_train_version(train_version)
        fates = self.ledger.lease_fates(filtered or [])
        unknown = [i for i in (filtered or []) if fates.get(i, (None, 0))[0] is not LeaseState.SUBMITTED]
        if unknown:
            raise NotFound(f"filtered_lease_ids: {unknown[0]!r} was never submitted")
        self.expire(now)
        s = self._state.copy()
        named = list(dict.fromkeys(filtered or []))
        filtered_rows = [self._delivered[i] for i in named if i in self._delivered]
        # A trainer reports the groups it filtered at its next fetch, which can come after the
        # checkpoint of their step consumed them: they were not trained all the same.
        consumed_filtered = self.ledger.consumed_groups(i for i in named if i not in self._delivered)
        ahead = self._ahead - sum(int(f.train_version > current) for f in filtered_rows)
        s.trainer_step = max(s.trainer_step, step)
        delivered: list[DeliveredGroup] = []
        delivered_rows: list[_Delivered] = []
        stale: list[_Queued] = []
        eta = self.settings.max_staleness_versions
        reply_bytes = FETCH_REPLY_OVERHEAD
        keep = self.settings.keep_delivered_payloads
        for q in self._queue.values() if not s.paused else ():
            if len(delivered) >= max_groups:
                break
            staleness = version - q.min_version
            if eta is not None and staleness > eta:
                stale.append(q)
                continue
            if max_reply_bytes is not None:
                size = len(q.payload) + FETCH_GROUP_OVERHEAD
                if reply_bytes + size > max_reply_bytes:
                    if not delivered:
                        raise ResourceExhausted(
                            f"the group of lease {q.lease_id} takes {size} bytes, more than the reply limit of "
                            f"{max_reply_bytes} bytes; raise coordinator.max_message_mb (the trainer's client "
                            "limit follows it) or lower data.max_response_length / rollout.n"
                        )
                    break
                reply_bytes += size
            delivered.append(DeliveredGroup(q.lease_id, q.seq, staleness, q.payload))
            delivered_rows.append(
                _Delivered(q.group_id, q.lease_id, q.seq, q.min_version, step, staleness, q.qpos, keep)
            )
        if version > current:
            ahead += len(delivered_rows)
        for d in delivered_rows:
            s.histogram[d.staleness] = s.histogram.get(d.staleness, 0) + 1
        for staleness in [f.staleness for f in filtered_rows] + [st for _, _, st, _ in consumed_filtered]:
            s.histogram[staleness] -= 1
        untrained = len(filtered_rows) + len(consumed_filtered)
        s.totals.consumed += len(delivered_rows) - untrained
        s.totals.filtered += untrained
        s.totals.regenerated += len(stale)
        floor = self.in_flight + self.queued - len(delivered_rows) - len(stale) + ahead
        # A filtered group gives its unit back only while the count still holds it: one delivered
        # before the last commit left it there (reset to in_flight + queued); one fetched ahead
        # for the version committed since was kept in it.
        held = sum(int(f.train_version >= current) for f in filtered_rows)
        held += sum(int(tv >= current) for _, _, _, tv in consumed_filtered)
        s.budget_used = max(floor, s.budget_used - held - len(stale))
        if delivered_rows or untrained or stale or s.trainer_step != self._state.trainer_step:
            with self.ledger.transaction():
                self.ledger.deliver_groups(
                    (d.group_id, d.step, d.staleness, d.has_payload) for d in delivered_rows
                )
                self.ledger.set_group_state([f.group_id for f in filtered_rows] + [g for g, _, _, _ in consumed_filtered],
                                            GroupState.FILTERED, drop_payload=True)
                self.ledger.set_group_state([q.group_id for q in stale], GroupState.REJECTED_STALE, drop_payload=True)
                self.ledger.push_retry([q.seq for q in stale], RetryReason.STALE)
                self.ledger.save_state(s.to_json())
        self._state = s
        self._ahead = ahead
        for f in filtered_rows:
            del self._delivered[f.lease_id]
        for d in delivered_rows:
            del self._queue[d.group_id]
            self._delivered[d.lease_id] = d
        for q in stale:
            del self._queue[q.group_id]
            self._retry[q.seq] = None
        return Batch(
            groups=delivered,
            policy_version=s.policy_version,
            exhausted=self.exhausted,
            checkpoint_requested=s.checkpoint_requested,
            stop_requested=s.stopping,
            regenerated=len(stale),
        )

    def check_train_version(self, train_version: int | None) -> int:
        """FetchBatch's train_version, or the current version when unset."""
        current = self._state.policy_version
        if train_version is None:
            return current
        if not current <= train_version <= current + 1:
            raise FailedPrecondition(
                f"train_version {train_version}: a trainer fetches for the current version ({current}) or the "
                f"next ({current + 1}) only; commit version {train_version - 1} before fetching groups to train "
                f"at {train_version}"
            )
        return train_version

    def commit_version(self, version: int, weights: bytes) -> tuple[int, int]:
        """Make `version` current (must be current + 1; re-committing the current version with the
        same weights is a no-op) and reset the budget to in_flight + queued (+ groups fetched ahead
        to train at it)."""
        cur = self._state.policy_version
        if version == cur and weights == self._state.weights:
            return cur, self._state.budget_used
        if version != cur + 1:
            raise FailedPrecondition(f"weights.policy_version must be {cur + 1} (current is {cur}), got {version}")
        s = self._state.copy()
        s.policy_version = version
        s.weights = weights
        # Groups fetched ahead to train at this version stay counted, as they would have been
        # still queued had the trainer fetched after this commit; from now on they are current.
        s.budget_used = self._floor()
        self._save(s)
        self._ahead = 0
        return version, s.budget_used

    def report_checkpoint(self, step: int, version: int, path: str) -> None:
        """Groups delivered at or before `step` are now part of a durable checkpoint. `step` is
        one the trainer fetched for (<= the trainer step), `version` one that was committed."""
        check_int64(step, "step")
        if step < self._state.last_checkpoint_step:
            raise FailedPrecondition(f"step {step} is older than the last checkpoint step {self._state.last_checkpoint_step}")
        if step > self._state.trainer_step:
            raise FailedPrecondition(
                f"step {step} is past the trainer's step {self._state.trainer_step}: a checkpoint covers only steps "
                "the trainer fetched groups for"
            )
        if not 0 <= version <= self._state.policy_version:
            raise InvalidArgument(
                "policy_version", f"{version} is not a committed version (current is {self._state.policy_version})"
            )
        done = [d for d in self._delivered.values() if d.step <= step]
        if ahead := [d for d in done if d.train_version > self._state.policy_version]:
            # they hold budget units of the next window until that version commits (fetch's
            # train_version); consumed now, the window after the commit would lease past the rule
            raise FailedPrecondition(
                f"step {ahead[0].step}'s groups are to be trained at version {ahead[0].train_version}, which is not "
                f"committed (current is {self._state.policy_version}): CommitVersion({ahead[0].train_version}) before "
                f"reporting a checkpoint of step {step}"
            )
        s = self._state.copy()
        s.last_checkpoint_step = step
        s.last_checkpoint_path = path
        s.checkpoint_requested = False
        with self.ledger.transaction():
            self.ledger.consume_through_step(step)
            self.ledger.save_state(s.to_json())
        self._state = s
        for d in done:
            del self._delivered[d.lease_id]  # none was fetched ahead (refused above): _ahead stays

    def resume_trainer(self, checkpoint_step: int) -> int:
        """A trainer restarted from `checkpoint_step`: groups delivered after it go back to the
        head of the queue in their original order (prompts of groups whose payload was dropped go
        back to the retry queue). Returns how many were returned."""
        check_int64(checkpoint_step, "checkpoint_step")
        if checkpoint_step > self._state.trainer_step:
            # it would move trainer_step past what was delivered, and a later ReportCheckpoint
            # of that step would mark delivered, untrained groups consumed
            raise FailedPrecondition(
                f"checkpoint_step {checkpoint_step} is past the last step this coordinator delivered groups for "
                f"({self._state.trainer_step}): the checkpoint is not from this run's ledger (coordinator.ledger_path)"
            )
        # Resumed from an older checkpoint than the last one reported (a rollback, or a newest
        # checkpoint that went missing): the groups of the steps in between were consumed into a
        # checkpoint this trainer did not load, their payloads dropped. Their prompts are issued
        # again, like the delivered groups without a payload below, and the checkpoint mark goes
        # back with the trainer (else its next ReportCheckpoint is refused as older).
        rolled_back = self.ledger.consumed_after_step(checkpoint_step) if checkpoint_step < self._state.last_checkpoint_step else []
        if rolled_back:
            log.warning("trainer_resumed_before_last_checkpoint", checkpoint_step=checkpoint_step,
                        last_checkpoint_step=self._state.last_checkpoint_step, groups_regenerated=len(rolled_back),
                        note="the groups of the steps in between go back to the rollouts as prompts")
        back = sorted((d for d in self._delivered.values() if d.step > checkpoint_step), key=lambda d: d.qpos)
        with_payload = [d for d in back if d.has_payload]
        without = [d for d in back if not d.has_payload]
        payloads = self.ledger.payloads([d.group_id for d in with_payload])
        moves: list[tuple[int, int]] = []
        head: OrderedDict[int, _Queued] = OrderedDict()
        s = self._state.copy()
        base = s.min_qpos - len(with_payload)
        for i, d in enumerate(with_payload):
            payload = payloads.get(d.group_id)
            assert payload is not None, f"delivered group {d.group_id} lost its payload in the ledger"
            qpos = base + i
            head[d.group_id] = _Queued(d.group_id, d.lease_id, d.seq, d.min_version, qpos, payload)
            moves.append((d.group_id, qpos))
        s.min_qpos = min(s.min_qpos, base)
        for d in back:
            s.histogram[d.staleness] -= 1
        for _, _, staleness, _ in rolled_back:
            s.histogram[staleness] -= 1
        s.totals.consumed -= len(back) + len(rolled_back)
        s.totals.regenerated += len(without) + len(rolled_back)
        # Outstanding work again. The count (module docstring) still holds the unit of a group
        # delivered since the last commit, or fetched ahead for the version committed since
        # (train_version >= current): back in the queue it keeps that unit, an older group takes
        # one; a prompt sent back to retry gives back the unit the count held for it.
        v = s.policy_version
        takes = sum(int(d.train_version < v) for d in with_payload)
        gives = sum(int(d.train_version >= v) for d in without) + sum(int(tv >= v) for _, _, _, tv in rolled_back)
        floor = self.in_flight + self.queued + len(with_payload) + self._ahead - sum(int(d.train_version > v) for d in back)
        s.budget_used = max(floor, s.budget_used + takes - gives)
        s.trainer_step = checkpoint_step
        s.last_checkpoint_step = min(s.last_checkpoint_step, checkpoint_step)
        with self.ledger.transaction():
            self.ledger.requeue_groups(moves)
            self.ledger.set_group_state([d.group_id for d in without] + [g for g, _, _, _ in rolled_back],
                                        GroupState.REJECTED_STALE)
            self.ledger.push_retry([d.seq for d in without] + [seq for _, seq, _, _ in rolled_back], RetryReason.TRAINER_RESUME)
            self.ledger.save_state(s.to_json())
        self._state = s
        for d in back:
            del self._delivered[d.lease_id]
            self._ahead -= int(d.train_version > s.policy_version)
        for d in without:
            self._retry[d.seq] = None
        for _, seq, _, _ in rolled_back:
            self._retry[seq] = None
        head.update(self._queue)
        self._queue = head
        return len(back)

    # ---- control ---------------------------------------------------------------------------

    def set_paused(self, paused: bool) -> None:
        """Pause or resume leasing; resuming also lifts a halt on failures (after the ledger took it)."""
        s = self._state.copy()
        s.paused = paused
        if not paused:
            s.halted_reason, s.halt_session = "", ""
        self._save(s)
        if not paused:
            self.failures.clear()

    def set_staleness(self, threshold: float) -> int:
        check_staleness_threshold(threshold)
        s = self._state.copy()
        s.staleness_threshold = float(threshold)
        self._save(s)
        return self.max_required_samples

    def request_checkpoint(self) -> None:
        s = self._state.copy()
        s.checkpoint_requested = True
        self._save(s)

    def stop(self) -> None:
        s = self._state.copy()
        if not s.stopping:
            s.stop_version, s.stop_weights = s.policy_version, s.weights
        s.stopping = True
        s.stop_session = self.settings.session
        self._save(s)

    @property
    def paused(self) -> bool:
        return self._state.paused

    @property
    def stopping(self) -> bool:
        return self._state.stopping

    @property
    def weights(self) -> bytes:
        return self._state.weights

    def announced(self) -> tuple[int, bytes]:
        """The version rollouts are told of, and its weights: the newest, or once the run is
        stopping the one current at the Stop (a version committed later reaches no rollout:
        CommitVersionResponse.stopping)."""
        if self._state.stopping:
            return self._state.stop_version, self._state.stop_weights
        return self._state.policy_version, self._state.weights

    # ---- inspection ------------------------------------------------------------------------

    def status(self, now: float) -> Status:
        self.expire(now)
        window = self.settings.lease_timeout_s
        return Status(
            run_id=self._state.run_id,
            policy_version=self._state.policy_version,
            paused=self._state.paused,
            stopping=self._state.stopping,
            staleness_threshold=self._state.staleness_threshold,
            required_samples=self.settings.required_samples,
            max_required_samples=self.max_required_samples,
            budget_used=self._state.budget_used,
            max_staleness_versions=self.settings.max_staleness_versions,
            prompts_total=self.settings.prompts_total,
            in_flight=self.in_flight,
            queued=self.queued,
            retry_pending=len(self._retry),
            delivered_uncheckpointed=len(self._delivered),
            totals=Totals(**self._state.totals.__dict__),
            histogram={k: v for k, v in sorted(self._state.histogram.items()) if v},
            trainer_step=self._state.trainer_step,
            last_checkpoint_step=self._state.last_checkpoint_step,
            checkpoint_requested=self._state.checkpoint_requested,
            active_replicas=sorted(r for r, t in self._replica_seen.items() if now - t <= window),
            weights=self._state.weights,
            failures=self.failures.reports(),
            halted_reason=self.failures.halted_reason,
        )

    def audit(self) -> dict[str, Any]:
        """Check from the ledger that every issued prompt is in exactly one place. Returns a report
        with `lost` and `duplicated` sequence numbers (both empty when the books balance). On the
        owner's thread; audit_ledger reads the same off it."""
        return _audit_report(self._state.cursor, self.ledger.live_seqs())


def audit_ledger(ledger: Ledger) -> dict[str, Any]:
    """CoordinatorCore.audit from one snapshot of the ledger's file, on a connection of its own:
    safe in a thread beside the core (asyncio.to_thread) while it goes on writing."""
    return _audit_report(*ledger.audit_view())


def _audit_report(cursor: int, where: dict[str, list[int]]) -> dict[str, Any]:
    counts: dict[int, int] = {}
    for seqs in where.values():
        for s in seqs:
            counts[s] = counts.get(s, 0) + 1
    issued = range(cursor)
    lost = [s for s in issued if s not in counts]
    duplicated = sorted(s for s, n in counts.items() if n > 1)
    return {
        "issued": cursor,
        "in_flight": len(where["in_flight"]),
        "retry": len(where["retry"]),
        "groups": len(where["groups"]),
        "set_aside": len(where["set_aside"]),
        "lost": lost,
        "duplicated": duplicated,
        "balanced": not lost and not duplicated,
    }
