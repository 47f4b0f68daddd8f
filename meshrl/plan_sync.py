"""`meshrl plan CONFIG --link-gbps X`: seconds per weight version, on paper.

The model (the numbers it was checked against are in BENCHMARKS.md, "Weight sync on paper"):

    B          bytes of one version: parameters x the bytes of the dtype the trainer exports
    L          X / 8 GB/s: one device's link (one NIC per device, as 8 x 400G nodes have; on one
               host, the device's NVLink bandwidth per direction)
    S          senders: 1 (rank 0 gathers and broadcasts every byte), or every trainer rank with
               `param_server.collective_sharded` (each sends the rows it owns)
    receive    every rollout node must take in all B bytes; NCCL's broadcast rings spread them
               over the node's links, so a node takes in at most min(S, devices per node) x L
               (one sender's broadcast runs at one link's speed into any one node)
    wire_s   = B / (min(S, rollout devices per node) x L)
               the broadcast is pipelined, so the number of rollout nodes adds latency, not time
    gather_s = B / L (rank 0 only, trainer sharded over more than one device): rank 0's export
               all-gathers the full tensors while it sends them; the two overlap bucket by bucket,
               so the slower of them sets the pace
    expected_s = max(wire_s, gather_s) / efficiency
               efficiency: what the transport reaches of a raw broadcast of the same bytes
               (0.6-0.75 measured on 2 H100 / H200 for one sender; BENCHMARKS.md)

It ignores per-bucket latency (~0.2 ms per 512 MiB bucket: under 1% at these sizes), the copy of
every byte to every device inside a rollout node (NVLink / HCCS, usually several times a NIC), the
host export of engines that go through host memory, and links shared with training traffic.
"""

from __future__ import annotations

from typing import Any

from services.common.config import MeshConfig
from services.common.model_arch import ModelArch

DEFAULT_EFFICIENCY = 0.7
"""The nccl transport's share of a raw broadcast, one sender, 8 GiB (BENCHMARKS.md: 0.58-0.74 on
H100 and H200 from 2026-11-26 to 27)."""


def export_bytes_per_param(cfg: MeshConfig) -> int:
    """Bytes per parameter of what the trainer exports: its parameter dtype."""
    return 4 if cfg.actor_rollout_ref.model.dtype == "float32" else 2


def weight_sync_estimate(cfg: MeshConfig, arch: ModelArch, link_gbps: float,
                         efficiency: float = DEFAULT_EFFICIENCY) -> dict[str, Any]:
    """Seconds per version for rank-0 and every-rank sync (the config's own mode marked)."""
    if link_gbps <= 0:
        raise ValueError(f"--link-gbps must be positive, got {link_gbps}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"the transport efficiency must be in (0, 1], got {efficiency}")
    nbytes = arch.total_params * export_bytes_per_param(cfg)
    link = link_gbps / 8 * 1e9
    trainer_world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    per_node = cfg.rollout.n_gpus_per_node
    sharded_ok = cfg.actor_rollout_ref.actor.strategy in ("fsdp", "fsdp2")

    def case(senders: int, gather: bool) -> dict[str, float]:
        wire = nbytes / (min(senders, per_node) * link)
        gather_s = nbytes / link if gather else 0.0
        return {"senders": senders, "wire_s": round(wire, 3), "gather_s": round(gather_s, 3),
                "expected_s": round(max(wire, gather_s) / efficiency, 3)}

    rank0 = case(1, trainer_world > 1)
    every = case(trainer_world, False)
    mode = "every_rank" if cfg.param_server.collective_sharded else "rank0"
    return {
        "bytes_per_version": nbytes,
        "link_gbps": link_gbps,
        "efficiency": efficiency,
        "rollout_devices_per_node": per_node,
        "mode": mode,
        "rank0": rank0,
        "every_rank": {**every, "available": sharded_ok},
        "speedup_every_rank": round(rank0["expected_s"] / every["expected_s"], 2),
        "note": "every_rank needs param_server.collective_sharded=true and the fsdp engine"
        if not sharded_ok or mode == "rank0" else "",
    }
