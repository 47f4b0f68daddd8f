"""Proto <-> Python for the rollout service: prompts to token ids, sampling params, engine outputs
to Response / TrajectoryGroup, score items. The only module that knows both sides."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from meshrl.v1 import common_pb2, reward_pb2
from services.common.data import chat_prompt_text
from services.common.errors import InvalidArgument

from .agent.trajectory import verl_num_turns
from .engines.base import Finish, SampleOutput, SamplingSpec

_FINISH = {
    Finish.STOP: common_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    Finish.ABORT: common_pb2.FINISH_REASON_ABORT,
}
Truncation = Literal["error", "left", "right", "middle"]


def prompt_text(prompt: common_pb2.Prompt, tokenizer: Any) -> str:
    """The prompt as the model sees it: the chat template applied (with the generation prompt) to
    `messages`, or `text` verbatim."""
    if prompt.messages and prompt.text:
        raise InvalidArgument("prompt", "set exactly one of messages or text, not both")
    if not prompt.messages and not prompt.text:
        raise InvalidArgument("prompt", "empty: set messages or text")
    return chat_prompt_text([{"role": m.role, "content": m.content} for m in prompt.messages], prompt.text, tokenizer)


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt as the engine gets it (`token_ids`) and as the reward sees it (`text`: the
    prompt text, or the text of the kept tokens when it was truncated)."""

    text: str
    token_ids: list[int]


def encode_prompt(
    prompt: common_pb2.Prompt, tokenizer: Any, *, max_prompt_length: int | None = None, truncation: Truncation = "error"
) -> EncodedPrompt:
    text = prompt_text(prompt, tokenizer)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if max_prompt_length is None or len(ids) <= max_prompt_length:
        return EncodedPrompt(text, ids)
    if truncation == "left":
        ids = ids[-max_prompt_length:]
    elif truncation == "right":
        ids = ids[:max_prompt_length]
    elif truncation == "middle":
        head = max_prompt_length // 2
        ids = ids[:head] + ids[len(ids) - (max_prompt_length - head):]
    else:
        raise _too_long(prompt, len(ids), max_prompt_length)
    return EncodedPrompt(str(tokenizer.decode(ids, skip_special_tokens=False)), ids)


def _too_long(prompt: common_pb2.Prompt, n: int, max_prompt_length: int) -> InvalidArgument:
    return InvalidArgument(
        "prompt", f"{prompt.prompt_id or 'prompt'} has {n} tokens > data.max_prompt_length={max_prompt_length}; "
        "raise data.max_prompt_length, set data.truncation=left|right|middle or data.filter_overlong_prompts=true",
    )


def sampling_spec(params: common_pb2.SamplingParams, *, seed_offset: int = 0, where: str = "sampling") -> SamplingSpec:
    """SamplingParams -> SamplingSpec. Proto3 zeros mean "unset": n=0 -> 1, top_p=0 -> 1,
    top_k=0 -> off. A seed is offset by `seed_offset` (per prompt) so groups differ."""
    if params.max_tokens == 0:
        raise InvalidArgument(f"{where}.max_tokens", "must be >= 1")
    seed = (params.seed + seed_offset) % (1 << 63) if params.HasField("seed") else None
    return SamplingSpec(
        n=params.n or 1,
        temperature=params.temperature,
        top_p=params.top_p or 1.0,
        top_k=-1 if params.top_k in (0, -1) else params.top_k,
        max_tokens=params.max_tokens,
        stop=tuple(params.stop),
        seed=seed,
    ).validate(where)


def response(out: SampleOutput) -> common_pb2.Response:
    assert len(out.token_ids) == len(out.logprobs) == len(out.versions), "per-token lists must align"
    return common_pb2.Response(
        sample_index=out.index,
        token_ids=out.token_ids,
        logprobs=out.logprobs,
        versions=out.versions,
        finish_reason=_FINISH[out.finish_reason],
        text=out.text,
        num_resumes=out.num_resumes,
    )


def group(
    *,
    lease_id: str,
    prompt: common_pb2.Prompt,
    prompt_ids: Sequence[int],
    outputs: Sequence[SampleOutput],
    replica_id: str,
    fallback_version: int,
    generation_s: float,
) -> common_pb2.TrajectoryGroup:
    g = common_pb2.TrajectoryGroup(
        lease_id=lease_id, prompt=prompt, prompt_token_ids=list(prompt_ids), replica_id=replica_id,
        generation_s=generation_s,
    )
    versions = [v for o in outputs for v in o.versions]
    g.min_policy_version = min(versions) if versions else fallback_version
    g.max_policy_version = max(versions) if versions else fallback_version
    g.responses.extend(response(o) for o in outputs)
    return g


def score_items(group: common_pb2.TrajectoryGroup, prompt_str: str, max_tokens: int) -> list[reward_pb2.ScoreItem]:
    """One item per response. A multi-turn trajectory (loss_mask set) is scored on its final
    answer (the last assistant turn); its tokens from its first policy token on, environment
    tokens between turns included, are what DAPO's overlong shaping counts (verl's response
    attention mask; the environment tokens before it are the rest of the sample's own first
    prompt); its extra_info gains verl's `num_turns` and `rollout_reward_scores` (the
    environment's reward, when it gave one)."""
    p = group.prompt
    items = []
    for r in group.responses:
        multi = bool(r.loss_mask)
        first = next((i for i, m in enumerate(r.loss_mask) if m), len(r.loss_mask)) if multi else 0
        items.append(reward_pb2.ScoreItem(
            item_id=f"{group.lease_id}/{r.sample_index}",
            prompt_text=prompt_str,
            response_text=r.final_text if multi else r.text,
            response_token_ids=r.token_ids[first:],
            ground_truth=p.ground_truth,
            data_source=p.data_source,
            extra_info_json=_agent_extra_info(p.extra_info_json, r) if multi else p.extra_info_json,
            policy_version=max(r.versions) if r.versions else group.max_policy_version,
            max_response_length=max_tokens,
            truncated=r.finish_reason == common_pb2.FINISH_REASON_LENGTH,
        ))
    return items


def _agent_extra_info(extra_json: str, r: common_pb2.Response) -> str:
    extra = json.loads(extra_json) if extra_json else {}
    extra["num_turns"] = verl_num_turns(r)  # which a reward function ported from verl reads
    extra["rollout_reward_scores"] = {"env_reward": r.env_reward} if r.HasField("env_reward") else {}
    return json.dumps(extra, separators=(",", ":"))


def apply_scores(group: common_pb2.TrajectoryGroup, results: Sequence[reward_pb2.ScoreResult]) -> None:
    by_id = {r.item_id: r for r in results}
    for r in group.responses:
        item_id = f"{group.lease_id}/{r.sample_index}"
        res = by_id.get(item_id)
        if res is None:
            raise InvalidArgument("ScoreResponse.results", f"no result for item {item_id!r}")
        r.reward = res.score
        r.reward_metrics.clear()
        r.reward_metrics.update(dict(res.metrics))
