"""The rows of each parameter that this FSDP rank owns, for the weight sync from every rank
(`param_server.collective_sharded`; the wire names and the receiver's reassembly are in
services/weights/shards.py).

FSDP2 shards each parameter along dim 0 (`Shard(0)`, torch.chunk's uneven split); with HSDP the
mesh also has a `Replicate()` dim, whose coordinate-0 ranks send and the others send nothing (the
same rows would arrive twice). A parameter that is not a DTensor (one rank, unsharded) travels
whole from rank 0; a placement this module does not know (another sharded dim) is gathered with
`full_tensor()` on every rank (a collective: all ranks take the same branch, since they iterate
the same parameters with the same placements) and sent whole by rank 0.

Every tensor yielded is a copy on the parameter's device: the broadcast goes on while the next
optimizer steps change the parameters, so it must not read them (host copies, as the rank-0
export makes, would cost a device-to-host and a host-to-device copy of every byte).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from services.weights.shards import shard_name


def local_shards(
    model: torch.nn.Module, rank: int, rename: Callable[[str], str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(wire name, copy of the rows this rank owns) per parameter, in `named_parameters` order;
    `rename` maps a parameter's name to the one it is published under (a released checkpoint's,
    as `export_weights` does) before the rows are named."""
    for name, param in model.named_parameters():
        if rename is not None:
            name = rename(name)
        if not isinstance(param, DTensor):
            if rank == 0:
                yield name, param.detach().clone()
            continue
        placements = param.placements
        if param.dim() == 0 or not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in placements):
            full = param.full_tensor()
            if rank == 0:
                yield name, full.detach().clone()
            continue
        coord = param.device_mesh.get_coordinate()
        if coord is None or any(isinstance(p, Replicate) and c != 0 for p, c in zip(placements, coord, strict=True)):
            continue
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, placements)
        rows = int(param.shape[0])
        start, stop = int(offset[0]), int(offset[0]) + int(shape[0])
        if stop <= start:
            continue  # fewer rows than ranks: this rank owns none of them
        local = param.to_local()
        assert tuple(local.shape) == tuple(shape), f"{name}: local shard {tuple(local.shape)} != {tuple(shape)}"
        wire = name if (start, stop) == (0, rows) else shard_name(name, start, stop, rows)
        yield wire, local.detach().clone()
