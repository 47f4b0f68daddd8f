"""Proto <-> core conversion and request validation for the coordinator (the only module that
knows both). Validation errors name the offending field as a path into the request."""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshrl.v1 import common_pb2, coordinator_pb2
from services.common.data import prompt_to_proto
from services.common.errors import InvalidArgument

from .core import Batch, GrantedLease, GroupIn, LeaseGrant, LeaseLimit, Status, SubmitStatus
from .wire import RawSubmit, SerializedReply, as_raw_submit, fetch_reply

_LIMIT = {
    LeaseLimit.NONE: coordinator_pb2.LEASE_LIMIT_NONE,
    LeaseLimit.STALENESS_BUDGET: coordinator_pb2.LEASE_LIMIT_STALENESS_BUDGET,
    LeaseLimit.PAUSED: coordinator_pb2.LEASE_LIMIT_PAUSED,
    LeaseLimit.EXHAUSTED: coordinator_pb2.LEASE_LIMIT_EXHAUSTED,
    LeaseLimit.STOPPING: coordinator_pb2.LEASE_LIMIT_STOPPING,
    LeaseLimit.MESSAGE_SIZE: coordinator_pb2.LEASE_LIMIT_MESSAGE_SIZE,
}
_SUBMIT = {
    SubmitStatus.ACCEPTED: coordinator_pb2.SUBMIT_STATUS_ACCEPTED,
    SubmitStatus.DUPLICATE: coordinator_pb2.SUBMIT_STATUS_DUPLICATE,
    SubmitStatus.EXPIRED: coordinator_pb2.SUBMIT_STATUS_EXPIRED,
}

MAX_ID_CHARS = 256
MAX_PATH_CHARS = 4096
MAX_ADDRESS_CHARS = 1024
MAX_CHECKSUM_CHARS = 128
LEASE_REPLY_OVERHEAD = 64
"""Bytes of a LeasePromptsResponse besides its leases and sampling params."""
MIN_REPLY_BYTES = 1024
"""The smallest `max_reply_bytes` a caller may ask for (below it no reply is useful)."""


def lease_wire_bytes(lease: GrantedLease) -> int:
    """Bytes one lease takes in a LeasePromptsResponse (its field tag and length included)."""
    pl = coordinator_pb2.PromptLease(lease_id=lease.lease_id, deadline_unix_s=lease.deadline,
                                     policy_version=lease.policy_version)
    prompt_to_proto(lease.seq, lease.prompt, pl.prompt)
    return pl.ByteSize() + 6


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


def check_length(value: str, field: str, limit: int) -> str:
    if len(value) > limit:
        raise InvalidArgument(field, f"is {len(value)} characters long; the limit is {limit}")
    return value


def reply_limit(server_limit: int, request: coordinator_pb2.LeasePromptsRequest | coordinator_pb2.FetchBatchRequest) -> int:
    """The largest reply to send: the server's message limit or the caller's, whichever is smaller."""
    if request.HasField("max_reply_bytes"):
        if request.max_reply_bytes < MIN_REPLY_BYTES:
            raise InvalidArgument("max_reply_bytes", f"must be at least {MIN_REPLY_BYTES} (a reply's framing and "
                                  f"one item), got {request.max_reply_bytes}; leave it unset for the server's limit")
        return min(server_limit, request.max_reply_bytes)
    return server_limit


def check_count(n: int, field: str, lo: int, hi: int) -> int:
    if not lo <= n <= hi:
        raise InvalidArgument(field, f"must be in [{lo}, {hi}], got {n}")
    return n


def policy_versions(r: common_pb2.Response, where: str) -> Sequence[int]:
    """The versions of a response's policy tokens: all of them, or those with loss_mask 1 in a
    multi-turn trajectory (its environment tokens carry no version, so staleness counts the oldest
    policy token)."""
    mask = r.loss_mask
    if not mask:
        return r.versions
    if len(mask) != len(r.token_ids):
        raise InvalidArgument(f"{where}.loss_mask", f"has {len(mask)} entries for {len(r.token_ids)} tokens")
    if any(m > 1 for m in mask):
        raise InvalidArgument(f"{where}.loss_mask", "entries must be 0 (environment token) or 1 (policy token)")
    return [v for v, m in zip(r.versions, mask, strict=True) if m]


def _check_token_ids(ids: Sequence[int], field: str, vocab_size: int | None) -> None:
    if not ids:
        return
    lo, hi = min(ids), max(ids)
    if lo < 0:
        raise InvalidArgument(field, f"negative token id {lo} at index {list(ids).index(lo)}")
    if vocab_size is not None and hi >= vocab_size:
        raise InvalidArgument(
            field, f"token id {hi} at index {list(ids).index(hi)} is outside the model's vocabulary (size {vocab_size})"
        )


def _check_logprobs(values: Sequence[float], field: str) -> None:
    # One C-level pass: a sum of float32 values is finite exactly when every value is.
    if values and not math.isfinite(sum(values)):
        bad = next(i for i, v in enumerate(values) if not math.isfinite(v))
        raise InvalidArgument(field, f"non-finite logprob {values[bad]} at index {bad}")


def _check_response(rw: str, r: common_pb2.Response, max_tokens: int, vocab_size: int | None) -> None:
    """Raise InvalidArgument naming the first field of `r` that is wrong."""
    n = len(r.token_ids)
    if n > max_tokens:
        raise InvalidArgument(f"{rw}.token_ids", f"{n} tokens exceed the limit of {max_tokens}")
    if len(r.logprobs) != n:
        raise InvalidArgument(f"{rw}.logprobs", f"has {len(r.logprobs)} entries for {n} tokens")
    if len(r.versions) != n:
        raise InvalidArgument(f"{rw}.versions", f"has {len(r.versions)} entries for {n} tokens")
    if not math.isfinite(r.reward):
        raise InvalidArgument(f"{rw}.reward", f"must be finite, got {r.reward}")
    _check_token_ids(r.token_ids, f"{rw}.token_ids", vocab_size)
    _check_logprobs(r.logprobs, f"{rw}.logprobs")
    versions = policy_versions(r, rw)
    if versions and min(versions) < 0:
        raise InvalidArgument(f"{rw}.versions", f"negative policy version {min(versions)} on a policy token")
    raise AssertionError(f"{rw}: the fast check failed but no field is wrong")


def groups_from_request(
    req: RawSubmit | coordinator_pb2.SubmitGroupsRequest, *, max_groups: int, max_tokens: int,
    expected_n: int | None = None, vocab_size: int | None = None,
) -> list[GroupIn]:
    """Validate every submitted group (shape, token ids within the vocabulary, finite logprobs,
    consistent lengths and versions) and turn it into core input; a group's payload is the bytes
    it arrived as (see wire.py)."""
    raw = req if isinstance(req, RawSubmit) else as_raw_submit(req)
    require_id(raw.replica_id, "replica_id")
    check_count(len(raw.groups), "groups", 1, max_groups)
    out: list[GroupIn] = []
    for i, (g, payload) in enumerate(zip(raw.groups, raw.payloads, strict=True)):
        where = f"groups[{i}]"
        require_id(g.lease_id, f"{where}.lease_id")
        if not g.HasField("prompt"):
            raise InvalidArgument(f"{where}.prompt", "missing (the leased prompt, at least prompt_seq)")
        if not g.prompt_token_ids:
            raise InvalidArgument(f"{where}.prompt_token_ids",
                                  "empty; the trainer needs at least one prompt token before the responses")
        _check_token_ids(g.prompt_token_ids, f"{where}.prompt_token_ids", vocab_size)
        if not g.responses:
            raise InvalidArgument(f"{where}.responses", "empty; a group carries rollout.n responses")
        if expected_n is not None and len(g.responses) != expected_n:
            raise InvalidArgument(
                f"{where}.responses", f"has {len(g.responses)} responses; this run samples rollout.n={expected_n}"
            )
        lo, hi = None, None
        for j, r in enumerate(g.responses):
            # The common case in a few C-level passes; the field-by-field check (which names what is
            # wrong) runs only for a response that fails it.
            n = len(r.token_ids)
            rw = f"{where}.responses[{j}]"
            if n > max_tokens or len(r.logprobs) != n or len(r.versions) != n or not math.isfinite(r.reward):
                _check_response(rw, r, max_tokens, vocab_size)
            if n and (min(r.token_ids) < 0 or (vocab_size is not None and max(r.token_ids) >= vocab_size)
                      or not math.isfinite(sum(r.logprobs))):
                _check_response(rw, r, max_tokens, vocab_size)
            versions = policy_versions(r, rw)
            if versions:
                vmin, vmax = min(versions), max(versions)
                if vmin < 0:
                    _check_response(rw, r, max_tokens, vocab_size)
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
        out.append(GroupIn(g.lease_id, g.prompt.prompt_seq, lo, hi, payload))
    return out


def submit_response(statuses: list[SubmitStatus], queued: int) -> coordinator_pb2.SubmitGroupsResponse:
    return coordinator_pb2.SubmitGroupsResponse(statuses=[_SUBMIT[s] for s in statuses], queued=queued)


def batch_response(batch: Batch) -> SerializedReply:
    """The FetchBatchResponse, built around the stored group bytes (see wire.fetch_reply)."""
    head = coordinator_pb2.FetchBatchResponse(
        policy_version=batch.policy_version,
        exhausted=batch.exhausted,
        checkpoint_requested=batch.checkpoint_requested,
        stop_requested=batch.stop_requested,
        regenerated=batch.regenerated,
        staleness=[g.staleness for g in batch.groups],
    )
    return fetch_reply(head, [g.payload for g in batch.groups])


def weights_bytes(ref: common_pb2.WeightsRef) -> bytes:
    """The WeightsRef of CommitVersion, checked, in the wire form the core stores and every
    rollout is sent."""
    check_length(ref.param_server_address, "weights.param_server_address", MAX_ADDRESS_CHARS)
    check_length(ref.manifest_checksum, "weights.manifest_checksum", MAX_CHECKSUM_CHARS)
    if ref.total_bytes >= 1 << 63:
        raise InvalidArgument("weights.total_bytes", f"must be below 2^63, got {ref.total_bytes}")
    return ref.SerializeToString(deterministic=True)


def weights_ref(stored: bytes, version: int) -> common_pb2.WeightsRef:
    """What WatchVersions announces: the committed WeightsRef (version 0 before any commit)."""
    return common_pb2.WeightsRef.FromString(stored) if stored else common_pb2.WeightsRef(policy_version=version)


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
            prompts_set_aside=t.prompts_set_aside,
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
