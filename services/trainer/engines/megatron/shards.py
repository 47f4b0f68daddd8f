"""The part of the Hugging Face weights that one megatron rank owns, for the weight sync from every
rank (`param_server.collective_sharded`; wire names and the receiver's reassembly are in
services/weights/shards.py). No collective: each rank cuts HF slices out of its own parameters,
so a version leaves every rank at once instead of being gathered over TP / EP and funnelled
through the pipeline to global rank 0 (weights.py's export).

    rule (convert.py)  TP (or expert-TP) rank r of n holds     it sends, under HF names
    copy               the whole tensor                        the tensor, from rank 0 only
    vocab              padded rows [r*P/n, (r+1)*P/n)          those rows below the real vocabulary
    split (dim 0 / 1)  the r-th chunk along dim                rows / columns of that chunk
    gate_up            cat(gate chunk r, up chunk r)           rows of gate_proj and of up_proj
    qkv                query groups [r*G/n, (r+1)*G/n)         rows of q_proj, k_proj, v_proj

Who sends: a pipeline stage sends its own layers; an expert-parallel rank its own experts (global
numbers from `rule_for`). Replicas send nothing: dense tensors go from data-parallel (with
context-parallel) rank 0, expert tensors from expert-data-parallel rank 0, and a tied output
layer never (the input embedding carries it). Every HF element thus leaves exactly one rank, and
the receiver's ShardAssembler refuses overlaps and missing rows.

Every tensor yielded is a copy on the parameter's device: the broadcast goes on while the next
optimizer steps change the parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from services.common.model_arch import ModelArch
from services.weights.shards import shard_name

from .convert import ParallelCoords, ParamRule, split_qkv


@dataclass(frozen=True)
class Replicas:
    """This rank's place among the copies of its parameters: it sends dense tensors only at
    `dense == 0` (megatron's data-parallel rank with context parallelism), expert tensors only at
    `expert == 0` (the expert-data-parallel rank)."""

    dense: int = 0
    expert: int = 0


def _part(name: str, t: torch.Tensor, dim: int, start: int, full: int) -> tuple[str, torch.Tensor]:
    stop = start + int(t.shape[dim])
    return (name if (start, stop) == (0, full) else shard_name(name, start, stop, full, dim=dim)), t


def hf_slices(
    rule: ParamRule, local: torch.Tensor, arch: ModelArch, rank: int, size: int
) -> list[tuple[str, torch.Tensor]]:
    """(wire name, view or copy) of every HF slice held by `local`, rank `rank` of `size`'s shard
    of `rule` (shard_from_hf's output). The inverse of shard_from_hf, one rank at a time."""
    if rule.kind == "copy":
        return [(rule.hf_names[0], local)]
    if rule.kind == "vocab":
        per = int(local.shape[0])
        start, stop = rank * per, min((rank + 1) * per, arch.vocab_size)
        if stop <= start:
            return []  # this rank holds padding rows only
        return [_part(rule.hf_names[0], local[: stop - start], 0, start, arch.vocab_size)]
    if rule.kind == "split":
        per = int(local.shape[rule.dim])
        return [_part(rule.hf_names[0], local, rule.dim, rank * per, per * size)]
    if rule.kind == "gate_up":
        gate, up = local.chunk(2, dim=0)
        per = int(gate.shape[0])
        return [_part(n, t, 0, rank * per, per * size) for n, t in zip(rule.hf_names, (gate, up), strict=True)]
    if rule.kind == "qkv":  # each of q, k, v: this rank's groups are the rank-th equal run of rows
        return [_part(n, t, 0, rank * int(t.shape[0]), int(t.shape[0]) * size)
                for n, t in zip(rule.hf_names, split_qkv(local, arch), strict=True)]
    raise AssertionError(rule.kind)


def owned_slices(
    params: list[tuple[str, torch.Tensor, ParamRule]], arch: ModelArch, coords: ParallelCoords, replicas: Replicas
) -> Iterator[tuple[str, torch.Tensor]]:
    """(wire name, copy on the parameter's device) of every HF slice this rank sends, for the
    local parameters `params` (weights.local_params: name, parameter, rule)."""
    for _, param, rule in params:
        if rule.expert:
            if replicas.expert != 0:
                continue
            rank, size = coords.etp_rank, coords.etp_size
        else:
            if replicas.dense != 0:
                continue
            rank, size = coords.tp_rank, coords.tp_size
        if rule.kind == "copy" and rank != 0:
            continue
        data = param.detach()
        for wire, t in hf_slices(rule, data, arch, rank, size):
            if t.untyped_storage().data_ptr() == data.untyped_storage().data_ptr():  # a view: copy it
                t = t.clone(memory_format=torch.contiguous_format)
            yield wire, t.contiguous()  # a reshape that copied (q/k/v of a TP shard) is already its own
