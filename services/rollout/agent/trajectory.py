"""A multi-turn trajectory as the rollout builds it: segments of policy tokens (loss mask 1, with
logprob and version) and environment tokens (loss mask 0, logprob 0, version -1), in the order the
model read them, after the group's prompt ids. Engine- and source-agnostic: the agent loop and an
OpenAI-style gateway build the same thing, and `to_response` puts it on the wire
(meshrl.v1.Response)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from meshrl.v1 import common_pb2
from services.common.errors import BadReply

from ..engines.base import Finish

ENV_VERSION = -1
"""The version of an environment token: it was not sampled by any policy."""

_FINISH = {
    Finish.STOP: common_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    Finish.ABORT: common_pb2.FINISH_REASON_ABORT,
}


@dataclass
class Trajectory:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    finish_reason: Finish = Finish.STOP
    final_text: str = ""
    """The last assistant turn (special tokens removed): what the reward service scores."""
    text: str = ""
    """The whole response decoded with special tokens kept (logs)."""
    num_resumes: int = 0
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float | None = None
    env_metrics: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def policy_tokens(self) -> int:
        return sum(self.loss_mask)

    def add_policy(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        """Append one assistant turn's sampled tokens."""
        assert len(ids) == len(logprobs) == len(versions), "per-token lists must align"
        self.turn_starts.append(len(self.token_ids))
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        self.loss_mask.extend([1] * len(ids))

    def add_environment(self, ids: Sequence[int]) -> None:
        """Append environment / tool / user tokens (not trained)."""
        if not ids:
            return
        self.turn_starts.append(len(self.token_ids))
        self.token_ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([ENV_VERSION] * len(ids))
        self.loss_mask.extend([0] * len(ids))

    def add_reward(self, value: float | None, *, source: str = "environment") -> None:
        """Add an environment's step or close reward. One that is not finite is `source`'s fault
        (BadReply: the group fails and its lease goes back), never the rollout's own bad input."""
        if value is None:
            return
        if not math.isfinite(value):
            raise BadReply(source, f"gave a reward that is not finite ({value}); an environment's rewards must be finite")
        self.env_reward = value if self.env_reward is None else self.env_reward + value

    def add_metrics(self, metrics: Mapping[str, float]) -> None:
        for k, v in metrics.items():
            self.env_metrics[k] = self.env_metrics.get(k, 0.0) + float(v)

    def policy_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]

    def policy_token_ids(self) -> list[int]:
        return [t for t, m in zip(self.token_ids, self.loss_mask, strict=True) if m]


def to_response(t: Trajectory) -> common_pb2.Response:
    r = common_pb2.Response(
        sample_index=t.index, token_ids=t.token_ids, logprobs=t.logprobs, versions=t.versions,
        finish_reason=_FINISH[t.finish_reason], text=t.text, num_resumes=t.num_resumes, loss_mask=t.loss_mask,
        turn_starts=t.turn_starts, num_turns=t.num_turns, tool_calls=t.tool_calls, tool_errors=t.tool_errors,
        env_metrics=t.env_metrics, final_text=t.final_text,
    )
    if t.env_reward is not None:
        r.env_reward = t.env_reward
    return r


def verl_num_turns(r: common_pb2.Response) -> int:
    """verl's num_turns of a response (ToolAgentLoop: user turns + assistant turns + 1; its
    single-turn loop's 2): what verl gives the reward manager and plots as num_turns/mean.
    Response.num_turns counts the assistant turns only. A user turn is each run of environment
    tokens after the first policy token (a turn's tool answers, an interaction's message); the run
    before it is the rest of the sample's own first prompt."""
    mask = r.loss_mask
    first = next((i for i, m in enumerate(mask) if m), len(mask))
    user_turns = sum(1 for i in r.turn_starts if first < i < len(mask) and not mask[i])
    return max(r.num_turns, 1) + user_turns + 1
