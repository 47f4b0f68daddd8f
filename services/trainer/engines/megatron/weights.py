"""Loading a HF checkpoint into megatron model chunks, and exporting full HF-named weights from
them (for param_server and `save_hf`), across TP, EP/ETP, PP and VPP.

Export protocol (collective; every rank calls `export_hf`, in the same order):

    for each pipeline stage s:
        metadata: stage s's (name, shape, dtype) list, broadcast over each PP group
        for each local parameter of stage s (chunk by chunk):
            stage-s ranks: all-gather over TP (dense) or expert-TP, then EP (experts), merge
            the PP group that holds global rank 0: broadcast the HF tensors from stage s
    global rank 0 fills buckets and yields them; every other rank yields nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.common.errors import ConfigError
from services.common.model_arch import ModelArch
from services.weights import Bucket
from services.weights.layout import group_by_bytes

from .convert import ParallelCoords, ParallelGroups, ParamRule, merge_to_hf, rule_for, shard_from_hf


class HFCheckpoint:
    """Reads tensors by name from a HF safetensors directory (sharded or not), lazily."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            weight_map = {}
            with safe_open(str(self.path / "model.safetensors"), "pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise ConfigError(f"{self.path} has no model.safetensors(.index.json); set actor_rollout_ref.model.path to a HF checkpoint")
        self.weight_map = weight_map
        self._open: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        try:
            file = self.weight_map[name]
        except KeyError:
            raise ConfigError(f"tensor {name!r} is missing from the checkpoint at {self.path}") from None
        if file not in self._open:
            self._open[file] = safe_open(str(self.path / file), "pt")
        return self._open[file].get_tensor(name)  # type: ignore[no-any-return]


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module  # type: ignore[assignment]
    return chunk


def layer_map(chunk: torch.nn.Module) -> dict[int, int]:
    """Stage-local layer index -> global layer index (megatron's layer_number is 1-based global)."""
    model = unwrap(chunk)
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return {}
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(decoder.layers)}


def _rule(name: str, arch: ModelArch, lmap: dict[int, int], coords: ParallelCoords) -> ParamRule | None:
    if name.endswith("output_layer.weight") and arch.tie_word_embeddings:
        # Tied embeddings with PP > 1: the last stage's copy of the input embedding.
        return ParamRule("vocab", ("model.embed_tokens.weight",))
    return rule_for(name, arch, lambda i: lmap[i], coords)


@torch.no_grad()
def load_hf_into(
    chunks: list[torch.nn.Module], arch: ModelArch, ckpt: HFCheckpoint, coords: ParallelCoords, padded_vocab: int
) -> int:
    """Copy this rank's shards of every parameter from the checkpoint. Returns tensors loaded."""
    n = 0
    for chunk in chunks:
        lmap = layer_map(chunk)
        for name, param in unwrap(chunk).named_parameters():
            rule = _rule(name, arch, lmap, coords)
            assert rule is not None
            shard = shard_from_hf(rule, ckpt.get, arch, coords, padded_vocab)
            if tuple(shard.shape) != tuple(param.shape):
                raise ConfigError(
                    f"checkpoint tensor for {name} has shape {tuple(shard.shape)} after sharding, the model wants "
                    f"{tuple(param.shape)}; does config.json match the weights?"
                )
            param.data.copy_(shard.to(param.dtype))
            n += 1
    return n


def local_params(chunks: list[torch.nn.Module], arch: ModelArch, coords: ParallelCoords) -> list[tuple[str, torch.Tensor, ParamRule]]:
    out: list[tuple[str, torch.Tensor, ParamRule]] = []
    for chunk in chunks:
        lmap = layer_map(chunk)
        for name, param in unwrap(chunk).named_parameters():
            if name.endswith("output_layer.weight") and arch.tie_word_embeddings:
                continue  # exported once, as the input embedding
            rule = _rule(name, arch, lmap, coords)
            assert rule is not None
            out.append((name, param, rule))
    return out


def _gather(t: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _full_tensors(
    name: str, param: torch.Tensor, rule: ParamRule, arch: ModelArch, coords: ParallelCoords, lmap: Any, groups: ParallelGroups
) -> dict[str, torch.Tensor]:
    """Full HF tensors of one local parameter, after TP/ETP and EP gathers (collective)."""
    data = param.detach()
    if rule.kind == "copy":
        shards = [data]
    elif rule.expert:
        shards = _gather(data, groups.etp, coords.etp_size)
    else:
        shards = _gather(data, groups.tp, coords.tp_size)
    merged = merge_to_hf(rule, shards, arch)
    if not rule.expert or coords.ep_size == 1:
        return merged
    # Expert weights: every EP rank holds different experts at the same local index.
    out: dict[str, torch.Tensor] = {}
    per_rank: list[dict[str, torch.Tensor]] = []
    keys = list(merged)
    gathered = {k: _gather(merged[k], groups.ep, coords.ep_size) for k in keys}
    for r in range(coords.ep_size):
        other = ParallelCoords(coords.tp_rank, coords.tp_size, r, coords.ep_size, coords.etp_rank, coords.etp_size)
        r_rule = _rule(name, arch, lmap, other)
        assert r_rule is not None
        per_rank.append(dict(zip(r_rule.hf_names, [gathered[k][r] for k in keys], strict=True)))
    for d in per_rank:
        out.update(d)
    return out


def export_hf(
    chunks: list[torch.nn.Module], arch: ModelArch, coords: ParallelCoords, bucket_bytes: int, groups: ParallelGroups
) -> Iterator[Bucket]:
    """Full HF weights in buckets of at most `bucket_bytes` (a larger tensor travels alone).
    Collective: every rank must iterate to the end; only global rank 0 yields."""
    return group_by_bytes(_export_named(chunks, arch, coords, groups), bucket_bytes)


def _export_named(
    chunks: list[torch.nn.Module], arch: ModelArch, coords: ParallelCoords, groups: ParallelGroups
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full HF tensor, on global rank 0 (other ranks yield nothing), gathered one parameter
    at a time as the caller asks. Collective, as export_hf."""
    rank = dist.get_rank()
    pp_group, pp_size, pp_rank = groups.pp, coords.pp_size, coords.pp_rank
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_size > 1 else [rank]
    exporting = 0 in pp_ranks
    local = local_params(chunks, arch, coords)
    lmaps = {id(p): layer_map(c) for c in chunks for _, p in unwrap(c).named_parameters()}

    for stage in range(pp_size):
        mine = stage == pp_rank
        meta: list[Any] = [None]
        if mine:
            meta = [[(name, tuple(p.shape), rule) for name, p, rule in local]]
        if pp_size > 1 and exporting:
            dist.broadcast_object_list(meta, src=pp_ranks[stage], group=pp_group)
        for i, (name, _shape, rule) in enumerate(meta[0] or []):
            if mine:
                _, param, _ = local[i]
                tensors = _full_tensors(name, param, rule, arch, coords, lmaps[id(param)], groups)
            if pp_size > 1 and exporting:
                if mine:
                    shapes = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
                    box: list[Any] = [shapes]
                else:
                    box = [None]
                dist.broadcast_object_list(box, src=pp_ranks[stage], group=pp_group)
                if not mine:
                    tensors = {k: torch.empty(s, dtype=dt, device=_device(chunks)) for k, s, dt in box[0]}
                for k in sorted(tensors):
                    dist.broadcast(tensors[k], src=pp_ranks[stage], group=pp_group)
            if rank != 0:
                continue
            for k, t in tensors.items():
                yield k, t.detach().to("cpu", copy=True)


def _device(chunks: list[torch.nn.Module]) -> torch.device:
    for p in unwrap(chunks[0]).parameters():
        return p.device
    return torch.device("cpu")
