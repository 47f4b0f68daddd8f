"""Rendezvous for collective transports (nccl / hccl / gloo): who is in a group, at which rank,
where the sender listens, and a per-version barrier. No Ray, no gRPC, no waiting: the servicer
polls `sender_ready` / `receiver_ready` after every change.

    trainer rank 0 (sender)                 param server                 rollout ranks (receivers)
    TCPStore on a free port ─ check_in(v) ─▶ generation g, rank 0
                                             ◀─ check_in(v) ───────────── rank 1..n-1 (first come)
    ready when all n-1 checked in for v ◀──▶ ready once the sender is at v
    broadcast version v ════════════════════════════════════════════════▶ receive

A new generation starts when the sender checks in with a different address, port, size or
backend (it rebuilt its group after a failure), or when any member reports that it failed a
version in the current generation (`failed_generation`: it dropped its group, so no broadcast can
go through that generation again): every member, the sender included, then gets the new
generation, new ranks, and rebuilds its group. A receiver's answer is a barrier of the whole
group: it comes once the sender and every receiver checked in for the version in the current
generation, so no member is handed a generation that a late failure report retires afterwards
(every member's report comes before its check-in for the version). A sender's late check-in
from a store it has since replaced (a stalled rank waking up) is turned away and never opens a
generation of its own. A receiver asking for a version older than the one the sender is at is
told so (it should fetch the newer one) instead of joining a broadcast it would not follow; a
sender waiting for a version that a receiver already skipped (it checked in for a newer one
only) is told so at once instead of at its deadline.

Generations are never reused, also across a restart of the param server (its board starts from
the wall clock): a member still holding an old generation's group always rebuilds.

A member that is gone holds its rank until the group re-forms, and the group's size is fixed, so
its replacement finds the group full. A newcomer to a full group therefore takes the place of a
member the sender waits for (not checked in for the sender's version) that the board has not
heard from for `replace_after_s` (param_server.stall_timeout_s; a member's check-in call counts
as heard from every second while it waits): the generation is retired, every member joins the
new one, and the sender's barrier moves there with it. Without this, a replaced rollout replica
stalled the sender until its transfer deadline (param_server.transfer_timeout_s, 300 s).

The sender is in a generation it checked in to, or one that opened while it waited at its barrier
(its wait moves there). A generation that opened after its barrier was answered (a newcomer took
a silent member's place between versions) has no sender until its next check-in, and its
receivers are not answered before: they would form a process group that has no rank 0. While the
sender waits at no barrier, no member is waited for: any member silent for `replace_after_s` may
be replaced. A newcomer that asks for the version the sender already sent (a single rollout
replica killed right after receiving it, while the trainer has no groups to train a next version
on) is then answered only when the sender sends that version again: `wanted_again` tells the
trainer so (the "probe" role), and it does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from services.common.logging import get_logger

log = get_logger(__name__)

BACKENDS = ("nccl", "hccl", "gloo")


@dataclass
class GroupState:
    name: str
    generation: int
    world_size: int
    backend: str
    master_address: str
    master_port: int
    sender_id: str
    sender_version: int
    ranks: dict[str, int] = field(default_factory=dict)
    """receiver member_id -> rank (1..world_size-1) in this generation."""
    checked_in: dict[int, set[str]] = field(default_factory=dict)
    """policy_version -> receivers that asked for it in this generation."""
    delta_bases: dict[int, dict[str, int]] = field(default_factory=dict)
    """policy_version -> receiver -> the delta base it checked in with (delta sync)."""
    sender_in: bool = True
    """The sender checked in to this generation, or waited at its barrier when it opened: its
    receivers may be answered (module docstring)."""
    sender_waiting: bool = True
    """A sender's check-in for sender_version waits at its barrier (not answered yet)."""

    def delta_base(self, policy_version: int) -> int:
        """The base every receiver checked in for `policy_version` with (0: they differ, or one
        holds none): what the sender may send a delta against."""
        members = self.checked_in.get(policy_version, set())
        bases = {self.delta_bases.get(policy_version, {}).get(m, 0) for m in members}
        return bases.pop() if len(bases) == 1 and len(members) >= self.world_size - 1 else 0


@dataclass(frozen=True)
class Assignment:
    rank: int
    world_size: int
    master_address: str
    master_port: int
    backend: str
    generation: int
    policy_version: int


class RendezvousBoard:
    def __init__(self, *, replace_after_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 first_generation: int = 1) -> None:
        self._groups: dict[str, GroupState] = {}
        self._generations: dict[str, int] = {}
        self.first_generation = first_generation
        """Every group's first generation (the param server's: unique to this board, module docstring)."""
        self._seen: dict[tuple[str, str], float] = {}
        """(group, receiver) -> when its last check-in came (the board's clock)."""
        self.replace_after_s = replace_after_s
        self.clock = clock

    def group(self, name: str) -> GroupState | None:
        return self._groups.get(name)

    @staticmethod
    def _check_common(group: str, member_id: str, backend: str) -> None:
        if not group:
            raise InvalidArgument("group", "required (the collective group name)")
        if not member_id:
            raise InvalidArgument("member_id", "required (a stable id of this rank)")
        if backend not in BACKENDS:
            raise InvalidArgument("backend", f"{backend!r}; use one of {list(BACKENDS)}")

    def _open(self, old: GroupState, policy_version: int, *, world_size: int | None = None, backend: str | None = None,
              master_address: str | None = None, master_port: int | None = None, sender_id: str | None = None) -> GroupState:
        """A new generation of `old`'s group (the sender's new key where given): no ranks, no check-ins."""
        state = GroupState(
            old.name, self._next_generation(old.name), old.world_size if world_size is None else world_size, backend or old.backend,
            master_address or old.master_address, old.master_port if master_port is None else master_port,
            sender_id or old.sender_id, policy_version, sender_in=old.sender_waiting, sender_waiting=old.sender_waiting,
        )
        self._groups[old.name] = state
        # who was heard from when: kept for the members of `old` only (the others left)
        self._seen = {k: t for k, t in self._seen.items() if k[0] != old.name or k[1] in old.ranks}
        return state

    def _next_generation(self, group: str) -> int:
        gen = self._generations.get(group, self.first_generation - 1) + 1
        self._generations[group] = gen
        return gen

    def _retire(self, group: str, failed_generation: int) -> None:
        """A member failed a version in `failed_generation` and dropped its group: if that is the
        current generation, open the next one (same sender, same store)."""
        state = self._groups.get(group)
        if failed_generation and state is not None and state.generation == failed_generation:
            self._open(state, state.sender_version)

    def sender_check_in(
        self, group: str, member_id: str, *, world_size: int, backend: str, master_address: str,
        master_port: int, policy_version: int, failed_generation: int = 0,
    ) -> GroupState:
        self._check_common(group, member_id, backend)
        if world_size < 2:
            raise InvalidArgument("world_size", f"a broadcast group needs the sender and >= 1 receiver, got {world_size}")
        if not master_address or not 0 < master_port < 65536:
            raise InvalidArgument("master_address", "the sender must give the address and port its group listens on")
        self._retire(group, failed_generation)
        state = self._groups.get(group)
        key = (world_size, backend, master_address, master_port, member_id)
        if state is None:
            state = GroupState(group, self._next_generation(group), world_size, backend, master_address, master_port, member_id, policy_version)
            self._groups[group] = state
        elif _key(state) != key:
            if member_id == state.sender_id and policy_version < state.sender_version:
                raise FailedPrecondition(
                    f"group {group!r}: this sender already checked in for version {state.sender_version} from another "
                    f"store; this check-in for version {policy_version} is a stale one (the version is gone)"
                )
            state = self._open(state, policy_version, world_size=world_size, backend=backend,
                               master_address=master_address, master_port=master_port, sender_id=member_id)
        state.sender_version = policy_version
        state.sender_in = state.sender_waiting = True
        for v in [v for v in state.checked_in if v < policy_version]:
            del state.checked_in[v]
            state.delta_bases.pop(v, None)
        return state

    def sender_ready(self, group: str, policy_version: int, checked_in_as: GroupState | None = None) -> tuple[bool, str]:
        """(ready, progress) for the sender's barrier (the group's current state: the generation
        may have moved on since the sender checked in as `checked_in_as`, when a member reported a
        failure; its key may not: a newer check-in of its sender replaced this one, an error)."""
        cur = self._groups[group]
        if checked_in_as is not None and (_key(cur) != _key(checked_in_as) or cur.sender_version != policy_version):
            raise FailedPrecondition(
                f"group {group!r}: a newer check-in of its sender (version {cur.sender_version}, port {cur.master_port}) "
                f"replaced this one (version {policy_version}, port {checked_in_as.master_port}); the version is gone"
            )
        have = cur.checked_in.get(policy_version, set())
        skipped = sorted(m for v, ms in cur.checked_in.items() if v > policy_version for m in ms if m not in have)
        if skipped:
            raise FailedPrecondition(
                f"group {group!r}: the sender broadcasts version {policy_version} but receivers {skipped} asked for a "
                "newer version only (they skipped this one; the group re-forms at the next version)"
            )
        need = cur.world_size - 1
        return len(have) >= need, f"{len(have)} of {need} receivers checked in for version {policy_version} ({sorted(have)})"

    def sender_done(self, group: str, checked_in_as: GroupState, policy_version: int, *, answered: bool) -> None:
        """The sender's check-in for `policy_version` (as `checked_in_as`) returned: answered (it
        joins the generation it was answered with), or not (a deadline, a cancelled call: it joins
        none; the group's receivers wait for its next check-in). A newer check-in of the sender
        owns the group's state: nothing changes then."""
        cur = self._groups.get(group)
        if cur is None or _key(cur) != _key(checked_in_as) or cur.sender_version != policy_version:
            return
        cur.sender_waiting = False
        if not answered:
            cur.sender_in = False

    def wanted_again(self, group: str, policy_version: int) -> bool:
        """Whether every receiver of `group`'s current generation waits for `policy_version`, the
        version the sender checked in for last, in a generation the sender has not joined: the
        sender sent it already (a newcomer took the place of a member that left after receiving
        it) and must send it again, or nobody gets it."""
        state = self._groups.get(group)
        if state is None or state.sender_in or state.sender_version != policy_version:
            return False
        return len(state.checked_in.get(policy_version, set())) >= state.world_size - 1

    def receiver_check_in(self, group: str, member_id: str, *, backend: str, world_size: int,
                          policy_version: int, failed_generation: int = 0,
                          delta_base_version: int = 0) -> tuple[Assignment | None, bool]:
        """(the assignment once the sender and every receiver checked in for `policy_version` in
        the current generation, else None; whether this call changed the board)."""
        self._check_common(group, member_id, backend)
        if delta_base_version < 0:
            raise InvalidArgument("delta_base_version", f"{delta_base_version}; the version this receiver holds whole, or 0")
        state = self._groups.get(group)
        if state is None:
            return None, False
        if backend != state.backend:
            raise FailedPrecondition(
                f"group {group!r} broadcasts over {state.backend}; this member asked for {backend} (only ranks of "
                "one device kind can share a collective group: use grpc across device kinds)"
            )
        if world_size and world_size != state.world_size:
            raise FailedPrecondition(f"group {group!r} has world_size {state.world_size}, this member expects {world_size}")
        if state.sender_version > policy_version:  # checked before anything changes (a retire keeps sender_version)
            raise FailedPrecondition(
                f"group {group!r} is broadcasting version {state.sender_version}; version {policy_version} is gone "
                "from this group (fetch the newer version)"
            )
        changed = False
        if failed_generation and failed_generation == state.generation:
            self._retire(group, failed_generation)
            state = self._groups[group]
            changed = True
        now = self.clock()
        rank = state.ranks.get(member_id)
        if rank is None:
            taken = set(state.ranks.values())
            free = [r for r in range(1, state.world_size) if r not in taken]
            if not free:
                state = self._replace_gone(state, member_id, now)
                free = [1]
            changed = True
            rank = free[0]
            state.ranks[member_id] = rank
        self._seen[(group, member_id)] = now
        members = state.checked_in.setdefault(policy_version, set())
        if member_id not in members:
            members.add(member_id)
            changed = True
        state.delta_bases.setdefault(policy_version, {})[member_id] = delta_base_version
        if not state.sender_in or state.sender_version < policy_version or len(members) < state.world_size - 1:
            return None, changed
        return Assignment(rank, state.world_size, state.master_address, state.master_port, state.backend,
                          state.generation, policy_version), changed

    def _replace_gone(self, state: GroupState, newcomer: str, now: float) -> GroupState:
        """`newcomer` found the group full: retire the generation if a member the sender waits for
        (any member, while the sender waits at no barrier) has been silent for `replace_after_s`
        (it is gone; the newcomer takes its place), else turn the newcomer away."""
        waited_for = state.checked_in.get(state.sender_version, set()) if state.sender_waiting else set()
        silent = {m: now - self._seen.get((state.name, m), float("-inf")) for m in state.ranks if m not in waited_for}
        gone = sorted(m for m, s in silent.items() if s >= self.replace_after_s)
        if not gone:
            quiet = max(silent.values(), default=0.0)
            raise ResourceExhausted(
                f"group {state.name!r} is full ({state.world_size - 1} receivers: {sorted(state.ranks)}); this member "
                f"takes the place of one silent for {self.replace_after_s:g}s that the sender's barrier waits for "
                f"(any one between versions; param_server.stall_timeout_s; the quietest has been silent {quiet:.0f}s), "
                "or joins when the group re-forms"
            )
        for m in gone:
            self._seen.pop((state.name, m), None)
        log.warning("rendezvous_member_replaced", group=state.name, generation=state.generation, gone=gone,
                    newcomer=newcomer, policy_version=state.sender_version)
        return self._open(state, state.sender_version)

    def withdraw(self, group: str, member_id: str, policy_version: int) -> None:
        """A receiver stopped waiting for `policy_version` (its call was cancelled or timed out):
        it no longer counts toward the sender's barrier for it."""
        state = self._groups.get(group)
        if state is None:
            return
        members = state.checked_in.get(policy_version)
        if members is not None:
            members.discard(member_id)
            if not members:  # nothing left for the version: no entry either (caller-chosen keys)
                del state.checked_in[policy_version]
        bases = state.delta_bases.get(policy_version)
        if bases is not None:
            bases.pop(member_id, None)
            if not bases:
                del state.delta_bases[policy_version]


def _key(state: GroupState) -> tuple[int, str, str, int, str]:
    return state.world_size, state.backend, state.master_address, state.master_port, state.sender_id
