"""Process groups and device meshes of a training group.

Ranks are laid out as (dp, sp): rank = dp_index * sp_size + sp_index, so the ranks of one
Ulysses sequence-parallel group are neighbours (same node). FSDP shards over all ranks (or, with
`fsdp_size` < world size, shards within groups of `fsdp_size` and replicates across them, HSDP).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from services.common.device import apply_collective_env, collective_backend
from services.common.errors import ConfigError


def init_process_group(device: str, timeout_s: float) -> tuple[int, int]:
    """Join (or create) the default process group; returns (rank, world_size).

    Reads the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Without
    WORLD_SIZE the group is this process alone, on an in-memory store. On accelerators a CPU
    (gloo) backend is added so small CPU tensors (metrics, object lists) can be reduced too.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = collective_backend(device)
    apply_collective_env(backend)
    if device != "cpu":
        backend = f"cpu:gloo,{device}:{backend}"
    timeout = timedelta(seconds=timeout_s)
    if "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    return rank, world


@dataclass(frozen=True)
class Meshes:
    """The meshes one rank needs."""

    fsdp: DeviceMesh
    """1-D (FSDP) or 2-D (replicate, shard: HSDP) mesh for fully_shard."""
    dp_sp: DeviceMesh
    """2-D ("dp", "sp") mesh: data-parallel index and Ulysses group."""

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.dp_sp.get_group("sp")

    @property
    def sp_size(self) -> int:
        return self.dp_sp.size(1)

    @property
    def sp_rank(self) -> int:
        return self.dp_sp.get_local_rank("sp")

    @property
    def dp_size(self) -> int:
        return self.dp_sp.size(0)

    @property
    def dp_rank(self) -> int:
        return self.dp_sp.get_local_rank("dp")


def build_meshes(device: str, world_size: int, sp_size: int, fsdp_size: int) -> Meshes:
    """Meshes for `world_size` ranks with Ulysses degree `sp_size` and FSDP shard groups of
    `fsdp_size` (-1: all ranks)."""
    if world_size % sp_size:
        raise ConfigError(
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp_size} must divide the training world "
            f"size {world_size} (trainer.nnodes * trainer.n_gpus_per_node)"
        )
    shard = world_size if fsdp_size in (-1, 0) or fsdp_size >= world_size else fsdp_size
    if world_size % shard:
        raise ConfigError(
            f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size} must divide the training world size {world_size}"
        )
    if shard == world_size:
        fsdp = init_device_mesh(device, (world_size,), mesh_dim_names=("fsdp",))
    else:
        fsdp = init_device_mesh(device, (world_size // shard, shard), mesh_dim_names=("ddp", "fsdp"))
    dp_sp = init_device_mesh(device, (world_size // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    return Meshes(fsdp=fsdp, dp_sp=dp_sp)


def all_reduce_cpu(values: list[float], op: str = "sum") -> list[float]:
    """Reduce a few floats over the whole group (float64 on CPU: exact for counts)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        dist.all_reduce(t, op=reduce_op, group=_cpu_group())
    return [float(x) for x in t.tolist()]


_CPU_GROUP: dist.ProcessGroup | None = None


def _cpu_group() -> dist.ProcessGroup | None:
    """A gloo group for CPU tensors (None: the default group is already CPU-capable)."""
    global _CPU_GROUP
    backend = dist.get_backend()
    if "gloo" in str(backend):
        return None
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP


def all_gather_objects(obj: object) -> list[object]:
    """Every rank's `obj`, in rank order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_cpu_group())
    return out
