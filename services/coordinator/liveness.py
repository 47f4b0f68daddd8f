"""Which rollout replicas holding leases went silent (the coordinator's failure detector).

A rollout replica calls the coordinator all the time (LeasePrompts, SubmitGroups) and, while it
holds leases, RenewLeases every `rollout_worker.lease_renew_interval_s` (a few seconds): that is
its heartbeat. A replica that holds leases and has not been heard from for
`coordinator.replica_ttl_s` is taken for dead (kill -9, a lost node, a wedged process) and its
leases expire at once, so their prompts are re-issued within seconds, not at the lease deadline.
`coordinator.lease_timeout_s` stays the bound for a live replica that keeps renewing but never
answers.

    replica   lease ── renew ── renew ──✝
    coord.          heard     heard        ...silent...  heard + ttl: its leases expire
                                                         (checks at most every `interval_s`)

Time the coordinator itself did not run is not held against anyone: when two checks are further
apart than ttl / 4 (a coordinator restart, a stalled event loop), the heartbeats that arrived in
between may still be queued behind the check, so every lease holder is credited with the gap. The
holders of leases restored from the ledger count as heard when the first check runs.

No clock: every call takes `now`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection


class ReplicaLiveness:
    """Answers which lease holders are silent from `last_heard` (shared with the caller, which
    updates it on every call from a replica). That table is bounded for ids callers choose
    (limits.RecentlySeen): a flood of new ids can push a holder out of it, so the holders' own
    times are kept here too (bounded by the holders), and a holder missing there is never taken
    as just heard. One owner; not thread-safe."""

    def __init__(self, last_heard: dict[str, float], ttl_s: float | None, *, interval_s: float = 1.0) -> None:
        self.last_heard = last_heard
        self.ttl_s = ttl_s
        self.interval_s = min(interval_s, ttl_s / 8) if ttl_s is not None else interval_s
        self._checked_at: float | None = None
        self._holders: dict[str, float] = {}

    def heard(self, replica_id: str, now: float) -> float:
        """When `replica_id` was last heard (the later of the shared table and this one's)."""
        times = [t for t in (self.last_heard.get(replica_id), self._holders.get(replica_id)) if t is not None]
        return max(times) if times else now

    def silent(self, now: float, holders: Callable[[], Collection[str]]) -> set[str]:
        """Replicas among `holders()` (those holding active leases: called only when a check is
        due, it may cost a pass over the leases) not heard from for more than ttl_s at `now`.
        Empty without a ttl, and between checks closer than interval_s."""
        if self.ttl_s is None:
            return set()
        last = self._checked_at
        if last is not None and now - last < self.interval_s:
            return set()
        self._checked_at = now
        holding = set(holders())
        if last is None:
            self._holders = {r: self.heard(r, now) for r in holding}  # restored holders: heard now
            return set()
        known = {r: self.heard(r, now) for r in holding if r in self.last_heard or r in self._holders}
        gap = now - last
        if gap > self.ttl_s / 4:
            # Only the holders are judged, so only they are credited: crediting every replica
            # ever heard would keep ids that stopped calling alive in the coordinator's bounded
            # table of recently seen replicas (GetStatus lists it).
            known = {r: min(t + gap, now) for r, t in known.items()}
        self._holders = {r: known.get(r, now) for r in holding}  # a new holder: heard now
        return {r for r, t in self._holders.items() if now - t > self.ttl_s}
