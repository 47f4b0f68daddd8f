"""Proto <-> core conversion and validation for the reward service (the only module that knows
both). Request errors name the field as a path into the request (`items[3].extra_info_json`);
errors in what an endpoint sent back name the endpoint."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from meshrl.v1 import reward_pb2
from services.common.errors import BadReply, InvalidArgument
from services.common.jsonutil import DEFAULT_MAX_DEPTH, loads_object

from .samples import Sample, Score

MAX_ID_CHARS = 256


def sample_from_item(item: reward_pb2.ScoreItem, where: str, *, max_json_depth: int = DEFAULT_MAX_DEPTH) -> Sample:
    if not item.item_id:
        raise InvalidArgument(f"{where}.item_id", "must be non-empty")
    if len(item.item_id) > MAX_ID_CHARS:
        raise InvalidArgument(f"{where}.item_id", f"longer than {MAX_ID_CHARS} characters")
    return Sample(
        item_id=item.item_id,
        data_source=item.data_source,
        response=item.response_text,
        ground_truth=item.ground_truth,
        prompt=item.prompt_text,
        response_token_ids=item.response_token_ids,  # the proto's repeated field, not copied
        extra_info=loads_object(item.extra_info_json, f"{where}.extra_info_json", max_depth=max_json_depth),
        policy_version=item.policy_version,
        max_response_length=item.max_response_length,
        truncated=item.truncated,
    )


def samples_from_items(
    items: Sequence[reward_pb2.ScoreItem], *, max_items: int, field: str = "items", max_json_depth: int = DEFAULT_MAX_DEPTH
) -> list[Sample]:
    """Validate and decode the items of a ScoreRequest. item_ids must be unique within it."""
    if len(items) > max_items:
        raise InvalidArgument(field, f"{len(items)} items exceed reward.max_items_per_request={max_items}; split the request")
    seen: dict[str, int] = {}
    out = []
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        sample = sample_from_item(item, where, max_json_depth=max_json_depth)
        if sample.item_id in seen:
            raise InvalidArgument(f"{where}.item_id", f"{sample.item_id!r} repeats {field}[{seen[sample.item_id]}]")
        seen[sample.item_id] = i
        out.append(sample)
    return out


def item_from_sample(s: Sample) -> reward_pb2.ScoreItem:
    return reward_pb2.ScoreItem(
        item_id=s.item_id,
        prompt_text=s.prompt,
        response_text=s.response,
        response_token_ids=list(s.response_token_ids),
        ground_truth=s.ground_truth,
        data_source=s.data_source,
        extra_info_json=json.dumps(dict(s.extra_info), separators=(",", ":")) if s.extra_info else "",
        policy_version=s.policy_version,
        max_response_length=s.max_response_length,
        truncated=s.truncated,
    )


def result_from_score(score: Score) -> reward_pb2.ScoreResult:
    return reward_pb2.ScoreResult(item_id=score.item_id, score=score.score, metrics=dict(score.metrics))


def score_response(scores: Sequence[Score]) -> reward_pb2.ScoreResponse:
    return reward_pb2.ScoreResponse(results=[result_from_score(s) for s in scores])


def scores_from_response(resp: reward_pb2.ScoreResponse, samples: Sequence[Sample], source: str) -> list[Score]:
    """Check what a RewardService sent back against what was asked (one result per item, in
    order, ids echoed, finite numbers). `source` names the sender in the error."""
    if len(resp.results) != len(samples):
        raise BadReply(source, f"returned {len(resp.results)} results for {len(samples)} items")
    out = []
    for i, (r, s) in enumerate(zip(resp.results, samples, strict=True)):
        if r.item_id != s.item_id:
            raise BadReply(source, f"results[{i}].item_id is {r.item_id!r}, expected {s.item_id!r} (results must be in request order)")
        if not math.isfinite(r.score):
            raise BadReply(source, f"results[{i}].score is {r.score} for item {s.item_id!r}")
        bad = [k for k, v in r.metrics.items() if not math.isfinite(v)]
        if bad:
            raise BadReply(source, f"results[{i}].metrics {bad} are not finite for item {s.item_id!r}")
        out.append(Score(r.item_id, r.score, dict(r.metrics)))
    return out

