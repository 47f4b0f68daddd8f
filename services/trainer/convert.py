"""TrajectoryGroups (protobuf) -> SequenceBatch (tensors) for training.

Sequence i = prompt_token_ids + response.token_ids, right-padded; position t concerns token t, so
the rollout's logprob of response token j (log p(r_j | prompt, r_<j)) lands at position
len(prompt) + j, exactly where the engine puts log p(x_t | x_<t).

The response mask is the loss mask: 1 on the tokens the policy sampled, 0 on the prompt, padding
and, in a multi-turn trajectory, the environment's tokens (Response.loss_mask 0). Every loss
aggregation, entropy, KL, off-policy correction and advantage in services/trainer/algos reads this
mask, so environment tokens carry no gradient and change no metric; lengths are policy tokens
(verl's `response_mask`).

    seq_tensors: group_index (group of the sequence in this batch), reward, response_length
                 (policy tokens), prompt_length, finish_length (1 where the response was cut at its
                 length limit: finish_reason LENGTH), min_version (of the policy tokens), plus every reward metric
                 the rollout reported (e.g. "acc"); for multi-turn trajectories also num_turns
                 (verl's: user + assistant turns + 1), assistant_turns, tool_calls, tool_errors,
                 trajectory_length (all response tokens), env_latency_s
    tensors:     rollout_logprobs (zeros outside the mask)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshrl.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.rollout.agent.trajectory import verl_num_turns

from .engines.base import SequenceBatch

AGENT_SEQ_TENSORS = ("num_turns", "assistant_turns", "tool_calls", "tool_errors", "trajectory_length", "env_latency_s")


def _loss_mask(r: common_pb2.Response, where: str, lease_id: str) -> list[float]:
    """The response's per-token loss mask as floats (all ones for a single-turn response)."""
    n = len(r.token_ids)
    if not r.loss_mask:
        return [1.0] * n
    if len(r.loss_mask) != n:
        raise InvalidArgument(f"{where}.loss_mask", f"{len(r.loss_mask)} entries for {n} tokens (lease {lease_id})")
    if any(m > 1 for m in r.loss_mask):
        raise InvalidArgument(f"{where}.loss_mask", f"entries must be 0 or 1 (lease {lease_id})")
    return [float(m) for m in r.loss_mask]


def sequence_tensors(groups: Sequence[common_pb2.TrajectoryGroup]) -> dict[str, torch.Tensor]:
    """The per-sequence tensors of `groups_to_batch` (seq_tensors), without the token tensors:
    what DAPO's filter compares, for a fetch that may be dropped."""
    group_index: list[int] = []
    rewards: list[float] = []
    min_versions: list[int] = []
    resp_len: list[int] = []
    finish_length: list[float] = []
    prompt_len: list[int] = []
    metric_names = sorted({k for g in groups for r in g.responses for k in r.reward_metrics})
    metrics: dict[str, list[float]] = {k: [] for k in metric_names}
    agentic = any(r.loss_mask or r.num_turns for g in groups for r in g.responses)
    agent: dict[str, list[float]] = {k: [] for k in AGENT_SEQ_TENSORS} if agentic else {}
    for gi, g in enumerate(groups):
        if not g.responses:
            raise InvalidArgument(f"groups[{gi}].responses", f"group {g.lease_id} has no responses")
        for ri, r in enumerate(g.responses):
            if r.loss_mask:
                mask = _loss_mask(r, f"groups[{gi}].responses[{ri}]", g.lease_id)
                versions = [v for v, m in zip(r.versions, mask, strict=False) if m]
                resp_len.append(int(sum(mask)))
            else:
                versions = list(r.versions)
                resp_len.append(len(r.token_ids))
            group_index.append(gi)
            prompt_len.append(len(g.prompt_token_ids))
            finish_length.append(1.0 if r.finish_reason == common_pb2.FINISH_REASON_LENGTH else 0.0)
            rewards.append(float(r.reward))
            min_versions.append(min(versions) if versions else g.min_policy_version)
            for k in metric_names:
                metrics[k].append(float(r.reward_metrics.get(k, r.reward)))
            if agentic:
                agent["num_turns"].append(float(verl_num_turns(r)))
                agent["assistant_turns"].append(float(r.num_turns or 1))
                agent["tool_calls"].append(float(r.tool_calls))
                agent["tool_errors"].append(float(r.tool_errors))
                agent["trajectory_length"].append(float(len(r.token_ids)))
                agent["env_latency_s"].append(float(r.env_metrics.get("env_latency_s", 0.0)))
    seq = {
        "group_index": torch.tensor(group_index, dtype=torch.long),
        "reward": torch.tensor(rewards, dtype=torch.float32),
        "response_length": torch.tensor(resp_len, dtype=torch.float32),
        "prompt_length": torch.tensor(prompt_len, dtype=torch.float32),
        "finish_length": torch.tensor(finish_length, dtype=torch.float32),
        "min_version": torch.tensor(min_versions, dtype=torch.long),
    }
    for k, values in agent.items():
        seq[k] = torch.tensor(values, dtype=torch.float32)
    for k, values in metrics.items():
        seq.setdefault(k, torch.tensor(values, dtype=torch.float32))
    return seq


def groups_to_batch(groups: Sequence[common_pb2.TrajectoryGroup], pad_token_id: int) -> SequenceBatch:
    """One row per response, groups in order, responses in sample order."""
    seq = sequence_tensors(groups)
    rows: list[tuple[list[int], list[int], list[float], list[float]]] = []
    for gi, g in enumerate(groups):
        prompt = list(g.prompt_token_ids)
        for ri, r in enumerate(g.responses):
            if len(r.logprobs) != len(r.token_ids):
                raise InvalidArgument(
                    f"groups[{gi}].responses[{ri}].logprobs",
                    f"{len(r.logprobs)} logprobs for {len(r.token_ids)} tokens (lease {g.lease_id})",
                )
            if not prompt:
                raise InvalidArgument(f"groups[{gi}].prompt_token_ids", f"empty prompt (lease {g.lease_id})")
            mask = _loss_mask(r, f"groups[{gi}].responses[{ri}]", g.lease_id)
            rows.append((prompt, list(r.token_ids), list(r.logprobs), mask))
    length = max((len(p) + len(t) for p, t, _, _ in rows), default=1)
    # One tensor per field from nested lists: a row-by-row fill costs far more for many short rows.
    ids_rows, attn_rows, resp_rows, lp_rows = [], [], [], []
    for prompt, tokens, logprobs, mask in rows:
        p, t = len(prompt), len(tokens)
        rest = length - p - t
        ids_rows.append(prompt + tokens + [pad_token_id] * rest)
        attn_rows.append([1] * (p + t) + [0] * rest)
        resp_rows.append([0.0] * p + mask + [0.0] * rest)
        # Environment tokens have no behaviour logprob: 0, like the prompt (and masked anyway).
        lp_rows.append([0.0] * p + [lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)] + [0.0] * rest)
    shape = (len(rows), length)
    ids = torch.tensor(ids_rows, dtype=torch.long).reshape(shape)
    attn = torch.tensor(attn_rows, dtype=torch.long).reshape(shape)
    resp = torch.tensor(resp_rows, dtype=torch.float32).reshape(shape)
    rollout_lp = torch.tensor(lp_rows, dtype=torch.float32).reshape(shape)
    return SequenceBatch(ids, attn, resp, tensors={"rollout_logprobs": rollout_lp}, seq_tensors=seq)


def check_batch(batch: SequenceBatch, vocab_size: int | None) -> None:
    """What the coordinator checks at its edge, checked again before a step: token ids within the
    vocabulary, finite rollout logprobs. A group that passed a coordinator that could not know
    the vocabulary (no local config.json) still never reaches the model."""
    ids = batch.input_ids[batch.attention_mask.bool()]
    if ids.numel() and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
        raise InvalidArgument(
            "groups.token_ids", f"token ids span [{int(ids.min())}, {int(ids.max())}], outside the vocabulary [0, {vocab_size})"
        )
    lp = batch.tensors["rollout_logprobs"]
    if not bool(torch.isfinite(lp).all()):
        row = int((~torch.isfinite(lp)).any(dim=1).nonzero()[0])
        raise InvalidArgument("groups.responses.logprobs", f"non-finite rollout logprob in batch row {row}")


def agent_metrics(batch: SequenceBatch) -> dict[str, float]:
    """Trajectory shape of a multi-turn batch (empty for single-turn batches): turns per
    trajectory (verl's num_turns: user + assistant turns + 1, as verl's num_turns/mean; and the
    assistant turns alone, what max_assistant_turns bounds), tool calls per trajectory, the
    fraction of trajectories that called a tool, tool errors per call, response tokens per
    trajectory (policy + environment), and the seconds a trajectory waited on its environment."""
    st = batch.seq_tensors
    if "num_turns" not in st:
        return {}
    calls = st["tool_calls"]
    return {
        "agent/num_turns/mean": float(st["num_turns"].mean()),
        "agent/num_turns/max": float(st["num_turns"].max()),
        "agent/num_turns/min": float(st["num_turns"].min()),
        "agent/assistant_turns/mean": float(st["assistant_turns"].mean()),
        "agent/tool_calls/mean": float(calls.mean()),
        "agent/tool_call_rate": float((calls > 0).float().mean()),
        "agent/tool_error_rate": float(st["tool_errors"].sum() / calls.sum().clamp(min=1)),
        "agent/trajectory_length/mean": float(st["trajectory_length"].mean()),
        "agent/env_latency_s/mean": float(st["env_latency_s"].mean()),
    }
def token_versions(groups: Sequence[common_pb2.TrajectoryGroup]) -> list[tuple[int, list[int]]]:
    """(prompt length, policy version of each response token) per batch row of `groups_to_batch`
    (a response without per-token versions counts at its group's min_policy_version)."""
    return [
        (len(g.prompt_token_ids), list(r.versions) if len(r.versions) else [g.min_policy_version] * len(r.token_ids))
        for g in groups
        for r in g.responses
    ]
