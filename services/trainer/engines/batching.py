"""Splitting batches: across data-parallel ranks, into micro-batches (a fixed count or a token
budget), and packing a micro-batch into one varlen row (`use_remove_padding`).

Every split keeps the original sequence order recoverable: functions return the indices they
took, so per-token results can be scattered back into place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.config.actor_rollout_ref import ActorConfig
from services.common.errors import InvalidArgument

from .base import SequenceBatch


def seq_lengths(batch: SequenceBatch) -> list[int]:
    """Real tokens per sequence (right padding excluded)."""
    return [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]


def trim(batch: SequenceBatch) -> SequenceBatch:
    """Drop trailing columns that are padding in every sequence."""
    if batch.num_seqs == 0:
        return batch
    length = max(1, max(seq_lengths(batch)))
    if length == batch.input_ids.shape[1]:
        return batch
    return SequenceBatch(
        input_ids=batch.input_ids[:, :length],
        attention_mask=batch.attention_mask[:, :length],
        response_mask=batch.response_mask[:, :length],
        tensors={k: v[:, :length] for k, v in batch.tensors.items()},
        seq_tensors=dict(batch.seq_tensors),
    )


def balanced_partition(weights: list[int], k: int) -> list[list[int]]:
    """Indices split into k bins with near-equal weight sums (greedy: heaviest item into the
    lightest bin). Bins keep ascending index order; bins may be empty when len(weights) < k."""
    if k < 1:
        raise InvalidArgument("k", f"must be >= 1, got {k}")
    bins: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in sorted(range(len(weights)), key=lambda j: (-weights[j], j)):
        b = min(range(k), key=lambda j: (sums[j], len(bins[j]), j))
        bins[b].append(i)
        sums[b] += weights[i]
    return [sorted(b) for b in bins]


def shard_for_dp(batch: SequenceBatch, dp_size: int) -> list[list[int]]:
    """Sequence indices per data-parallel rank, balanced by token count."""
    return balanced_partition(seq_lengths(batch), dp_size)


def micro_batch_indices(
    batch: SequenceBatch, *, max_seqs: int | None = None, max_tokens: int | None = None
) -> list[list[int]]:
    """Micro-batches of at most `max_seqs` sequences, or (with `max_tokens`) of at most that many
    real tokens each, balanced. A sequence longer than `max_tokens` is an error: it could never
    fit (raise ppo_max_token_len_per_gpu)."""
    n = batch.num_seqs
    if n == 0:
        return []
    if max_tokens is not None:
        lengths = seq_lengths(batch)
        longest = max(lengths)
        if longest > max_tokens:
            raise InvalidArgument(
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                f"a sequence has {longest} tokens but the micro-batch budget is {max_tokens}; raise it to at "
                "least the longest prompt + response",
            )
        k = max(1, -(-sum(lengths) // max_tokens))
        while True:
            bins = balanced_partition(lengths, k)
            if all(sum(lengths[i] for i in b) <= max_tokens for b in bins):
                return [b for b in bins if b]
            k += 1
    size = max_seqs or n
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def split_micro_batches(
    batch: SequenceBatch, *, max_seqs: int | None = None, max_tokens: int | None = None
) -> list[SequenceBatch]:
    """`micro_batch_indices` applied, each micro-batch trimmed of all-padding columns."""
    return [trim(batch.select(idx)) for idx in micro_batch_indices(batch, max_seqs=max_seqs, max_tokens=max_tokens)]


def token_budget(actor: ActorConfig) -> int:
    """Tokens of one micro-batch with use_dynamic_bsz: each of the SP ranks holds 1/sp of them."""
    return actor.ppo_max_token_len_per_gpu * actor.ulysses_sequence_parallel_size


def micro_batches_for(actor: ActorConfig, batch: SequenceBatch) -> list[SequenceBatch]:
    """A rank's training micro-batches as `actor` asks: by token budget (use_dynamic_bsz,
    ppo_max_token_len_per_gpu per device, so x ulysses_sequence_parallel_size per SP group, as in
    verl) or by count (ppo_micro_batch_size_per_gpu; null: one)."""
    if actor.use_dynamic_bsz:
        return split_micro_batches(batch, max_tokens=token_budget(actor))
    return split_micro_batches(batch, max_seqs=actor.ppo_micro_batch_size_per_gpu)


def concat(batches: list[SequenceBatch], pad_token_id: int = 0) -> SequenceBatch:
    """Stack batches along the sequence axis, right-padding to the longest."""
    assert batches, "concat needs at least one batch"
    length = max(b.input_ids.shape[1] for b in batches)

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value)

    keys = batches[0].tensors.keys()
    return SequenceBatch(
        input_ids=torch.cat([pad(b.input_ids, pad_token_id) for b in batches]),
        attention_mask=torch.cat([pad(b.attention_mask, 0) for b in batches]),
        response_mask=torch.cat([pad(b.response_mask, 0) for b in batches]),
        tensors={k: torch.cat([pad(b.tensors[k], 0) for b in batches]) for k in keys},
        seq_tensors={k: torch.cat([b.seq_tensors[k] for b in batches]) for k in batches[0].seq_tensors},
    )


def dummy_batch(length: int, pad_token_id: int, like: SequenceBatch | None = None) -> SequenceBatch:
    """One all-padding sequence (no response tokens) with a single real token: a forward pass
    that keeps a rank's collectives in step with ranks that have more micro-batches."""
    ids = torch.full((1, length), pad_token_id, dtype=torch.long)
    attn = torch.zeros((1, length), dtype=torch.long)
    attn[0, 0] = 1
    tensors = {k: torch.zeros((1, length), dtype=v.dtype) for k, v in (like.tensors.items() if like else [])}
    seq = {k: torch.zeros((1,), dtype=v.dtype) for k, v in (like.seq_tensors.items() if like else [])}
    return SequenceBatch(ids, attn, torch.zeros((1, length)), tensors, seq)


@dataclass(frozen=True)
class Packed:
    """A micro-batch packed into one row of T tokens (T a multiple of `multiple_of`)."""

    input_ids: torch.Tensor
    """[1, T] token ids; padding after the last sequence."""
    position_ids: torch.Tensor
    """[1, T] positions restarting at 0 for every sequence (and for the tail padding)."""
    offsets: list[int]
    """Start of each sequence in the row."""
    lengths: list[int]
    """Real tokens of each sequence."""

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """[start, end) of every segment of the row, the tail padding included."""
        out = [(o, o + n) for o, n in zip(self.offsets, self.lengths, strict=True) if n > 0]
        end, total = sum(self.lengths), int(self.input_ids.shape[1])
        return [*out, (end, total)] if end < total else out


def pack(batch: SequenceBatch, multiple_of: int = 1) -> Packed:
    """Concatenate the real tokens of every sequence into one row."""
    lengths = seq_lengths(batch)
    ids: list[torch.Tensor] = []
    pos: list[torch.Tensor] = []
    offsets: list[int] = []
    at = 0
    for i, n in enumerate(lengths):
        offsets.append(at)
        ids.append(batch.input_ids[i, :n])
        pos.append(torch.arange(n, dtype=torch.long))
        at += n
    tail = (-at) % multiple_of
    if tail or at == 0:
        tail = tail or multiple_of
        ids.append(torch.zeros(tail, dtype=torch.long))
        pos.append(torch.arange(tail, dtype=torch.long))
    return Packed(
        input_ids=torch.cat(ids).unsqueeze(0),
        position_ids=torch.cat(pos).unsqueeze(0),
        offsets=offsets,
        lengths=lengths,
    )


def unpack_next_token(values: torch.Tensor, packed: Packed, shape: tuple[int, int]) -> torch.Tensor:
    """Packed next-token values ([T]: value at p concerns the token at p+1) -> token-aligned
    [B, L] (value at t concerns token t; 0 at t=0 and on padding). Differentiable."""
    rows, cols, src = [], [], []
    for i, (o, n) in enumerate(zip(packed.offsets, packed.lengths, strict=True)):
        if n > 1:
            rows.append(torch.full((n - 1,), i, dtype=torch.long))
            cols.append(torch.arange(1, n, dtype=torch.long))
            src.append(torch.arange(o, o + n - 1, dtype=torch.long))
    out = values.new_zeros(shape[0] * shape[1])
    if not rows:  # stay on the graph (a dummy's zero loss must still run backward and FSDP's hooks)
        return out.view(shape) + values[:0].sum()
    device = values.device
    flat = (torch.cat(rows) * shape[1] + torch.cat(cols)).to(device)
    return out.index_put((flat,), values[torch.cat(src).to(device)]).view(shape)
