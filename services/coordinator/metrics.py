"""The coordinator's Prometheus families (services/common/metrics.py), from its core's status and,
less often, the ledger audit (a scan of the ledger)."""

from __future__ import annotations

from typing import Any

from services.common.metrics import Family, ReplicaMetrics

from .core import Status

STALENESS_BUCKETS = (0.5, 1.5, 2.5, 3.5, 4.5, 8.5, 16.5)
"""Staleness is a whole number of versions: each bucket boundary sits between two of them."""

FAMILIES = (
    Family("meshrl_coordinator_queue_depth", "Groups generated and waiting for the trainer."),
    Family("meshrl_coordinator_leases_in_flight", "Prompts leased to rollouts and not submitted yet."),
    Family("meshrl_coordinator_retry_pending", "Prompts waiting to be leased again (expired, returned, stale)."),
    Family("meshrl_coordinator_policy_version", "The newest committed policy version."),
    Family("meshrl_coordinator_budget_used", "Staleness budget used since the last commit (prompts)."),
    Family("meshrl_coordinator_budget_max", "max_required_samples: the staleness budget (prompts)."),
    Family("meshrl_coordinator_budget_use_ratio", "budget_used / budget_max."),
    Family("meshrl_coordinator_leases_granted", "Leases granted.", "counter"),
    Family("meshrl_coordinator_groups_submitted", "Groups submitted by rollouts.", "counter"),
    Family("meshrl_coordinator_groups_consumed", "Groups delivered to the trainer.", "counter"),
    Family("meshrl_coordinator_requeued", "Prompts re-queued, by reason (expired, returned, stale, filtered).",
           "counter", ("reason",)),
    Family("meshrl_coordinator_duplicate_submissions", "Submissions of an already submitted lease (idempotent).",
           "counter"),
    Family("meshrl_coordinator_prompts_set_aside",
           "Prompts set aside after coordinator.max_prompt_failures failures (never leased again).", "counter"),
    Family("meshrl_coordinator_staleness", "Staleness of each consumed group (versions).", "histogram",
           boundaries=STALENESS_BUCKETS),
    Family("meshrl_coordinator_prompts_lost", "Issued prompts the ledger audit finds nowhere (should be 0)."),
    Family("meshrl_coordinator_prompts_duplicated", "Prompts the ledger audit finds twice (should be 0)."),
)

REQUEUE_REASONS = {"expired": "leases_expired", "returned": "leases_returned", "stale": "regenerated",
                   "filtered": "filtered"}


def export(m: ReplicaMetrics, status: Status, audit: dict[str, Any] | None) -> None:
    """One export from a core Status (and an audit report when one was taken)."""
    m.set("meshrl_coordinator_queue_depth", status.queued)
    m.set("meshrl_coordinator_leases_in_flight", status.in_flight)
    m.set("meshrl_coordinator_retry_pending", status.retry_pending)
    m.set("meshrl_coordinator_policy_version", status.policy_version)
    m.set("meshrl_coordinator_budget_used", status.budget_used)
    m.set("meshrl_coordinator_budget_max", status.max_required_samples)
    m.set("meshrl_coordinator_budget_use_ratio", status.budget_used / max(1, status.max_required_samples))
    t = status.totals
    m.count_to("meshrl_coordinator_leases_granted", t.leases_granted)
    m.count_to("meshrl_coordinator_groups_submitted", t.submitted)
    m.count_to("meshrl_coordinator_groups_consumed", t.consumed)
    m.count_to("meshrl_coordinator_duplicate_submissions", t.duplicates)
    m.count_to("meshrl_coordinator_prompts_set_aside", t.prompts_set_aside)
    for reason, field in REQUEUE_REASONS.items():
        m.count_to("meshrl_coordinator_requeued", getattr(t, field), tags={"reason": reason})
    m.observe_counts("meshrl_coordinator_staleness", status.histogram)
    if audit is not None:
        m.set("meshrl_coordinator_prompts_lost", len(audit["lost"]))
        m.set("meshrl_coordinator_prompts_duplicated", len(audit["duplicated"]))
