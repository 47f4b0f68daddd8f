"""`meshrl plan CONFIG --link-gbps X`: seconds per weight version, on paper.

The model (the numbers it was checked against are in BENCHMARKS.md, "Weight sync on paper"):

    B          bytes of one version: parameters x the bytes of the dtype the trainer exports
    L          X / 8 GB/s: one device's link (one NIC per device, as 8 x 400G nodes have; on one
               host, the device's NVLink bandwidth per direction)
    S          senders: 1 (rank 0 gathers and broadcasts every byte), or every trainer rank with
               `param_server.collective_sharded` (each sends the part it owns). FSDP: the ranks of
               one shard group (fsdp_size, the world when -1) each send 1/S; replicas send nothing. megatron / mindspeed: replicas send nothing, so dense bytes leave the
               TP x PP ranks of one data-parallel replica, expert bytes the EP x ETP x PP ranks
               of one expert-data-parallel replica; S = the larger of the two counts, and the most
               loaded rank carries its stage's dense/TP + expert/(EP x ETP) (its stage's layers;
               embedding, LM head: meshrl.plan_layout.stage_params), an upper bound where the two
               kinds' senders are not the same ranks
    receive    every rollout node must take in all B bytes; NCCL's broadcast rings spread them
               over the node's links, so a node takes in at most min(S, devices per node) x L
               (one sender's broadcast runs at one link's speed into any one node)
    wire_s   = max(B / (min(S, rollout devices per node) x L), most loaded sender's bytes / L)
               the broadcast is pipelined, so the number of rollout nodes adds latency, not time
    gather_s = B / L (rank 0 only, the model sharded over more than one device, i.e. S > 1 in
               every-rank mode; pure data parallelism gathers nothing): rank 0's export
               all-gathers the full tensors while it sends them; the two overlap bucket by bucket,
               so the slower of them sets the pace
    expected_s = max(wire_s, gather_s) / efficiency
               efficiency: what the transport reaches of a raw broadcast of the same bytes
               (0.6-0.75 measured on 2 H100 / H200 for one sender; BENCHMARKS.md)

With delta sync (`param_server.delta_sync`; services/weights/delta.py), versions after the first
carry only the elements that changed since the version every rollout rank holds:

    f          the share of elements that change per version (--changed-fraction; verl reports
               1-3% of bf16 elements per RL step, 1.45-1.86% was measured at lr 1e-6)
    w          bytes per element on the wire: the rollout's dtype when it names one, else the export's
    delta B  = params x f x (4 + w)   an int32 index and the new value per changed element (a tensor
               whose delta would not be smaller goes whole: delta B is capped at params x w)
    delta wire_s = max(delta B / (min(S, rollout devices per node) x L), delta B x m / L)
               m: the most loaded sender's share of the version (1 for rank 0, 1/S for FSDP)
    device_s = params x w x (enc x m + dec)   the sender's compare and gather (each sender its own
               part, the most loaded one last) and each receiver's rebuild and check, per
               byte (H200: enc 4.1, dec 1.6 ms per GiB; BENCHMARKS.md, "Delta sync")
    expected_s = max(delta wire_s, gather_s) / efficiency + device_s
               rank 0's gather still moves every byte of a sharded trainer: there delta sync
               shortens the wire, not the gather

It ignores per-bucket latency (~0.2 ms per 512 MiB bucket: under 1% at these sizes), the copy of
every byte to every device inside a rollout node (NVLink / HCCS, usually several times a NIC), the
host export of engines that go through host memory, and links shared with training traffic.
"""

from __future__ import annotations

from typing import Any

from services.common.config import MeshConfig
from services.common.config.actor_rollout_ref import COLLECTIVE_BACKENDS
from services.common.model_arch import ModelArch

from .plan_layout import fsdp_shard_size, stage_params, trainer_param_bytes

DEFAULT_EFFICIENCY = 0.7
"""The nccl transport's share of a raw broadcast, one sender, 8 GiB (BENCHMARKS.md: 0.58-0.74 on
H100 and H200 from 2026-11-26 to 27)."""


DELTA_CHANGED_FRACTION = 0.02
"""Default share of elements that change per version (verl: 1-3% of bf16 elements per RL step)."""
DELTA_ENCODE_S_PER_GIB = 0.0041
DELTA_DECODE_S_PER_GIB = 0.0016
"""Delta sync's device work per GiB of wire-dtype weights, one H200: the sender's encode 16.3 ms and
a receiver's rebuild and check 6.5 ms per 4 GiB at 1.5% changed (BENCHMARKS.md, "Delta sync")."""
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def export_bytes_per_param(cfg: MeshConfig) -> int:
    """Bytes per parameter of what the trainer exports: its parameter dtype (FSDP: the engine's
    master dtype, `fsdp_config.model_dtype` when set; meshrl.plan_layout.trainer_param_bytes)."""
    return trainer_param_bytes(cfg)


def delta_wire_bytes_per_param(cfg: MeshConfig) -> int:
    """Bytes per element a delta carries values in: the rollout's dtype when it names one."""
    return _DTYPE_BYTES.get(cfg.actor_rollout_ref.rollout.dtype, export_bytes_per_param(cfg))


def weight_sync_estimate(cfg: MeshConfig, arch: ModelArch, link_gbps: float,
                         efficiency: float = DEFAULT_EFFICIENCY,
                         changed_fraction: float = DELTA_CHANGED_FRACTION) -> dict[str, Any]:
    """Seconds per version for rank-0 and every-rank sync (the config's own mode marked), and
    with delta sync in the config's mode."""
    if link_gbps <= 0:
        raise ValueError(f"--link-gbps must be positive, got {link_gbps}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"the transport efficiency must be in (0, 1], got {efficiency}")
    if not 0 <= changed_fraction <= 1:
        raise ValueError(f"--changed-fraction must be in [0, 1], got {changed_fraction}")
    nbytes = arch.total_params * export_bytes_per_param(cfg)
    link = link_gbps / 8 * 1e9
    trainer_world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    per_node = cfg.rollout.n_gpus_per_node
    arr = cfg.actor_rollout_ref
    # every engine sends its own part (TrainEngine.export_shards); the transport and LoRA decide
    sharded_ok = arr.rollout.checkpoint_engine.backend in COLLECTIVE_BACKENDS and arr.model.lora_rank == 0

    def case(senders: int, gather: bool, most_loaded: float) -> dict[str, float]:
        wire = max(nbytes / (min(senders, per_node) * link), most_loaded / link)
        gather_s = nbytes / link if gather else 0.0
        return {"senders": senders, "wire_s": round(wire, 3), "gather_s": round(gather_s, 3),
                "expected_s": round(max(wire, gather_s) / efficiency, 3)}

    every_senders = _every_rank_senders(cfg, arch, trainer_world)
    # rank 0 gathers only what other ranks own: nothing when every rank holds the whole model
    # (megatron TP = PP = EP = ETP = 1, FSDP shard groups of 1): the owners are every_rank's senders
    rank0 = case(1, every_senders[0] > 1, nbytes)
    every = case(*every_senders)
    mode = "every_rank" if cfg.param_server.collective_sharded else "rank0"
    whole = every if mode == "every_rank" else rank0
    return {
        "bytes_per_version": nbytes,
        "link_gbps": link_gbps,
        "efficiency": efficiency,
        "rollout_devices_per_node": per_node,
        "mode": mode,
        "rank0": rank0,
        "every_rank": {**every, "available": sharded_ok},
        "speedup_every_rank": round(rank0["expected_s"] / every["expected_s"], 2),
        "delta": _delta_case(cfg, arch.total_params, whole, link, per_node, efficiency, changed_fraction,
                             most_loaded_share=(every_senders[2] / nbytes if mode == "every_rank" else 1.0)),
        "note": "every_rank needs param_server.collective_sharded=true, a collective transport "
        "(checkpoint_engine.backend nccl, hccl or gloo) and no LoRA"
        if not sharded_ok or mode == "rank0" else "",
    }


def _every_rank_senders(cfg: MeshConfig, arch: ModelArch, world: int) -> tuple[int, bool, float]:
    """(senders, gather, bytes of the most loaded sender) with `param_server.collective_sharded`
    (the module docstring's S)."""
    arr = cfg.actor_rollout_ref
    per_param = export_bytes_per_param(cfg)
    if arr.actor.strategy not in ("megatron", "mindspeed"):
        shard = fsdp_shard_size(cfg)  # replicated groups (fsdp_size < world) send nothing
        return shard, False, arch.total_params * per_param / shard
    m = arr.actor.megatron
    tp, pp, ep = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size
    etp = m.expert_tensor_parallel_size or tp
    stages = stage_params(arch, m)
    most = max(dense / tp + expert / (ep * etp) for dense, expert in stages) * per_param
    has_experts = any(expert for _, expert in stages)
    senders = min(world, max(tp * pp, ep * etp * pp if has_experts else 0))
    return senders, False, min(most, arch.total_params * per_param)


def _delta_case(cfg: MeshConfig, params: int, whole: dict[str, float], link: float, per_node: int,
                efficiency: float, changed: float, most_loaded_share: float = 1.0) -> dict[str, Any]:
    """Delta sync in the config's mode (`whole`: that mode's case): a version after the first.
    `most_loaded_share`: the share of the version the most loaded sender owns (1 for rank 0)."""
    senders = int(whole["senders"])
    w = delta_wire_bytes_per_param(cfg)
    nbytes = min(params * changed * (4 + w), params * w)
    # as the whole version: the receiving node's links, or the most loaded sender's own link
    wire = max(nbytes / (min(senders, per_node) * link), nbytes * most_loaded_share / link)
    device = params * w / 2**30 * (DELTA_ENCODE_S_PER_GIB * most_loaded_share + DELTA_DECODE_S_PER_GIB)
    expected = round(max(wire, whole["gather_s"]) / efficiency + device, 3)
    arr = cfg.actor_rollout_ref
    return {
        "enabled": cfg.param_server.delta_sync,
        "available": arr.rollout.checkpoint_engine.backend in COLLECTIVE_BACKENDS and arr.model.lora_rank == 0,
        "changed_fraction": changed,
        "bytes_per_version": int(nbytes),
        "wire_s": round(wire, 3),
        "gather_s": whole["gather_s"],
        "device_s": round(device, 3),
        "expected_s": expected,
        "vs_whole": round(expected / whole["expected_s"], 3) if whole["expected_s"] else 1.0,
    }
