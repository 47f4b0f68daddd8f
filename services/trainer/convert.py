"""TrajectoryGroups (protobuf) -> SequenceBatch (tensors) for training.

Sequence i = prompt_token_ids + response.token_ids, right-padded; position t concerns token t, so
the rollout's logprob of response token j (log p(r_j | prompt, r_<j)) lands at position
len(prompt) + j, exactly where the engine puts log p(x_t | x_<t).

    seq_tensors: group_index (group of the sequence in this batch), reward, response_length,
                 min_version, plus every reward metric the rollout reported (e.g. "acc")
    tensors:     rollout_logprobs (zeros outside responses)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshrl.v1 import common_pb2
from services.common.errors import InvalidArgument

from .engines.base import SequenceBatch


def sequence_tensors(groups: Sequence[common_pb2.TrajectoryGroup]) -> dict[str, torch.Tensor]:
    """The per-sequence tensors of `groups_to_batch` (seq_tensors), without the token tensors:
    what DAPO's filter compares, for a fetch that may be dropped."""
    group_index: list[int] = []
    rewards: list[float] = []
    min_versions: list[int] = []
    resp_len: list[int] = []
    metric_names = sorted({k for g in groups for r in g.responses for k in r.reward_metrics})
    metrics: dict[str, list[float]] = {k: [] for k in metric_names}
    for gi, g in enumerate(groups):
        if not g.responses:
            raise InvalidArgument(f"groups[{gi}].responses", f"group {g.lease_id} has no responses")
        for r in g.responses:
            group_index.append(gi)
            rewards.append(float(r.reward))
            min_versions.append(min(r.versions) if len(r.versions) else g.min_policy_version)
            resp_len.append(len(r.token_ids))
            for k in metric_names:
                metrics[k].append(float(r.reward_metrics.get(k, r.reward)))
    seq = {
        "group_index": torch.tensor(group_index, dtype=torch.long),
        "reward": torch.tensor(rewards, dtype=torch.float32),
        "response_length": torch.tensor(resp_len, dtype=torch.float32),
        "min_version": torch.tensor(min_versions, dtype=torch.long),
    }
    for k, values in metrics.items():
        seq.setdefault(k, torch.tensor(values, dtype=torch.float32))
    return seq


def groups_to_batch(groups: Sequence[common_pb2.TrajectoryGroup], pad_token_id: int) -> SequenceBatch:
    """One row per response, groups in order, responses in sample order."""
    seq = sequence_tensors(groups)
    rows: list[tuple[list[int], list[int], list[float]]] = []
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
            rows.append((prompt, list(r.token_ids), list(r.logprobs)))
    length = max((len(p) + len(t) for p, t, _ in rows), default=1)
    # One tensor per field from nested lists: a row-by-row fill costs far more for many short rows.
    ids_rows, attn_rows, resp_rows, lp_rows = [], [], [], []
    for prompt, tokens, logprobs in rows:
        p, t = len(prompt), len(tokens)
        rest = length - p - t
        ids_rows.append(prompt + tokens + [pad_token_id] * rest)
        attn_rows.append([1] * (p + t) + [0] * rest)
        resp_rows.append([0.0] * p + [1.0] * t + [0.0] * rest)
        lp_rows.append([0.0] * p + logprobs + [0.0] * rest)
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


def token_versions(groups: Sequence[common_pb2.TrajectoryGroup]) -> list[tuple[int, list[int]]]:
    """(prompt length, policy version of each response token) per batch row of `groups_to_batch`
    (a response without per-token versions counts at its group's min_policy_version)."""
    return [
        (len(g.prompt_token_ids), list(r.versions) if len(r.versions) else [g.min_policy_version] * len(r.token_ids))
        for g in groups
        for r in g.responses
    ]
