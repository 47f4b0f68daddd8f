"""Proto <-> core conversion and request validation for the coordinator (the only module that
knows both). Validation errors name the offending field as a path into the request."""

from __future__ import annotations

import json
import math

from meshrl.v1 import common_pb2, coordinator_pb2
from services.common.data import PromptRecord
from services.common.errors import InvalidArgument

from .core import Batch, GroupIn, LeaseGrant, LeaseLimit, Status, SubmitStatus

_LIMIT = {
    LeaseLimit.NONE: coordinator_pb2.LEASE_LIMIT_NONE,
    LeaseLimit.STALENESS_BUDGET: coordinator_pb2.LEASE_LIMIT_STALENESS_BUDGET,
    LeaseLimit.PAUSED: coordinator_pb2.LEASE_LIMIT_PAUSED,
    LeaseLimit.EXHAUSTED: coordinator_pb2.LEASE_LIMIT_EXHAUSTED,
    LeaseLimit.STOPPING: coordinator_pb2.LEASE_LIMIT_STOPPING,
}
_SUBMIT = {
    SubmitStatus.ACCEPTED: coordinator_pb2.SUBMIT_STATUS_ACCEPTED,
    SubmitStatus.DUPLICATE: coordinator_pb2.SUBMIT_STATUS_DUPLICATE,
    SubmitStatus.EXPIRED: coordinator_pb2.SUBMIT_STATUS_EXPIRED,
}

MAX_ID_CHARS = 256


def prompt_to_proto(seq: int, record: PromptRecord, out: common_pb2.Prompt) -> None:
    out.prompt_seq = seq
    out.prompt_id = record.prompt_id
    for role, content in record.messages:
        out.messages.add(role=role, content=content)
    out.text = record.text
    out.data_source = record.data_source
    out.ability = record.ability
    out.ground_truth = record.ground_truth
    if record.extra_info:
        out.extra_info_json = json.dumps(record.extra_info, separators=(",", ":"))


def lease_response(grant: LeaseGrant, sampling: common_pb2.SamplingParams) -> coordinator_pb2.LeasePromptsResponse:
    resp = coordinator_pb2.LeasePromptsResponse(
        limit=_LIMIT[grant.limit], policy_version=grant.policy_version, sampling=sampling
    )
    for lease in grant.leases:
        pl = resp.leases.add(lease_id=lease.lease_id, deadline_unix_s=lease.deadline, policy_version=lease.policy_version)
        prompt_to_proto(lease.seq, lease.prompt, pl.prompt)
    return resp


def require_id(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument(field, "must be non-empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(field, f"longer than {MAX_ID_CHARS} characters")
    return value


def check_count(n: int, field: str, lo: int, hi: int) -> int:
    if not lo <= n <= hi:
        raise InvalidArgument(field, f"must be in [{lo}, {hi}], got {n}")
    return n


def groups_from_request(
    req: coordinator_pb2.SubmitGroupsRequest, *, max_groups: int, max_tokens: int, expected_n: int | None = None
) -> list[GroupIn]:
    """Validate the shape of every submitted group and turn it into core input."""
    require_id(req.replica_id, "replica_id")
    check_count(len(req.groups), "groups", 1, max_groups)
    out: list[GroupIn] = []
    for i, g in enumerate(req.groups):
        where = f"groups[{i}]"
        require_id(g.lease_id, f"{where}.lease_id")
        if not g.HasField("prompt"):
            raise InvalidArgument(f"{where}.prompt", "missing (the leased prompt, at least prompt_seq)")
        if not g.responses:
            raise InvalidArgument(f"{where}.responses", "empty; a group carries rollout.n responses")
        if expected_n is not None and len(g.responses) != expected_n:
            raise InvalidArgument(
                f"{where}.responses", f"has {len(g.responses)} responses; this run samples rollout.n={expected_n}"
            )
        lo, hi = None, None
        for j, r in enumerate(g.responses):
            rw = f"{where}.responses[{j}]"
            n = len(r.token_ids)
            if n > max_tokens:
                raise InvalidArgument(f"{rw}.token_ids", f"{n} tokens exceed the limit of {max_tokens}")
            if len(r.logprobs) != n:
                raise InvalidArgument(f"{rw}.logprobs", f"has {len(r.logprobs)} entries for {n} tokens")
            if len(r.versions) != n:
                raise InvalidArgument(f"{rw}.versions", f"has {len(r.versions)} entries for {n} tokens")
            if not math.isfinite(r.reward):
                raise InvalidArgument(f"{rw}.reward", f"must be finite, got {r.reward}")
            if n:
                vmin, vmax = min(r.versions), max(r.versions)
                if vmin < 0:
                    raise InvalidArgument(f"{rw}.versions", f"negative policy version {vmin}")
                lo = vmin if lo is None else min(lo, vmin)
                hi = vmax if hi is None else max(hi, vmax)
        if lo is None or hi is None:
            # No tokens at all (every response empty): the group is as old as its stated version.
            lo = hi = g.min_policy_version
        if g.min_policy_version != lo or g.max_policy_version != hi:
            raise InvalidArgument(
                f"{where}.min_policy_version",
                f"says [{g.min_policy_version}, {g.max_policy_version}] but the tokens span [{lo}, {hi}]",
            )
        out.append(GroupIn(g.lease_id, g.prompt.prompt_seq, lo, hi, g.SerializeToString()))
    return out


def submit_response(statuses: list[SubmitStatus], queued: int) -> coordinator_pb2.SubmitGroupsResponse:
    return coordinator_pb2.SubmitGroupsResponse(statuses=[_SUBMIT[s] for s in statuses], queued=queued)


def batch_response(batch: Batch) -> coordinator_pb2.FetchBatchResponse:
    resp = coordinator_pb2.FetchBatchResponse(
        policy_version=batch.policy_version,
        exhausted=batch.exhausted,
        checkpoint_requested=batch.checkpoint_requested,
        stop_requested=batch.stop_requested,
        regenerated=batch.regenerated,
        staleness=[g.staleness for g in batch.groups],
    )
    for g in batch.groups:
        resp.groups.add().MergeFromString(g.payload)
    return resp


def weights_to_dict(ref: common_pb2.WeightsRef) -> dict[str, object]:
    return {
        "policy_version": ref.policy_version,
        "param_server_address": ref.param_server_address,
        "manifest_checksum": ref.manifest_checksum,
        "total_bytes": ref.total_bytes,
    }


def weights_from_dict(d: dict[str, object], version: int) -> common_pb2.WeightsRef:
    return common_pb2.WeightsRef(
        policy_version=version,
        param_server_address=str(d.get("param_server_address", "")),
        manifest_checksum=str(d.get("manifest_checksum", "")),
        total_bytes=int(d.get("total_bytes", 0)),  # type: ignore[call-overload]
    )


def status_response(s: Status) -> coordinator_pb2.GetStatusResponse:
    t = s.totals
    resp = coordinator_pb2.GetStatusResponse(
        run_id=s.run_id,
        policy_version=s.policy_version,
        paused=s.paused,
        stopping=s.stopping,
        staleness_threshold=s.staleness_threshold,
        required_samples=s.required_samples,
        max_required_samples=s.max_required_samples,
        budget_used=s.budget_used,
        totals=coordinator_pb2.RunTotals(
            prompts_total=s.prompts_total,
            prompts_issued=t.prompts_issued,
            in_flight=s.in_flight,
            queued=s.queued,
            consumed=t.consumed,
            regenerated=t.regenerated,
            leases_granted=t.leases_granted,
            leases_expired=t.leases_expired,
            leases_returned=t.leases_returned,
            filtered=t.filtered,
            duplicates=t.duplicates,
            rejected_expired=t.rejected_expired,
            retry_pending=s.retry_pending,
            delivered_uncheckpointed=s.delivered_uncheckpointed,
            leases_replica_lost=t.leases_replica_lost,
        ),
        staleness_histogram=[coordinator_pb2.StalenessBucket(staleness=k, groups=v) for k, v in s.histogram.items()],
        trainer_step=s.trainer_step,
        last_checkpoint_step=max(s.last_checkpoint_step, 0),
        checkpoint_requested=s.checkpoint_requested,
        active_replicas=s.active_replicas,
        failures=[
            coordinator_pb2.FailureReport(source=f.source, error=f.error, count=f.count, first_unix_s=f.first_unix_s,
                                          last_unix_s=f.last_unix_s)
            for f in s.failures
        ],
        halted_reason=s.halted_reason,
    )
    if s.max_staleness_versions is not None:
        resp.max_staleness_versions = s.max_staleness_versions
    return resp
