"""The checks and numbers behind `meshrl plan`: parallel layouts against device counts and the
model's shape, and per-rank parameter / gradient / optimizer memory.

Memory model (bytes per parameter, stated so the numbers can be checked by hand):
  megatron: params in `model.dtype` (2 for bf16 / fp16, 4 for fp32), fp32 grads 4
            (grad_reduce_in_fp32), Adam fp32 master + m + v 12 (bf16 / fp16; fp32 params are
            their own master: m + v 8); params and grads split by TP x PP (dense) or
            ETP x EP x PP (experts); optimizer state additionally by DP x CP (dense) or expert-DP
            with the distributed optimizer. Tied embeddings with PP > 1: the last stage holds its
            own copy of the embedding (megatron's output_layer).
  fsdp:     params and grads in the engine's master dtype (`fsdp_config.model_dtype` when set,
            else `model.dtype`; hf_model.master_dtype), torch AdamW's m + v in the same dtype
            (no separate fp32 master), all sharded over the FSDP group.
Offload flags move the at-rest copy to host memory; activations and KV are not estimated.
"""

from __future__ import annotations

import math
from typing import Any

from services.common.config import MeshConfig
from services.common.config.actor_rollout_ref import MegatronConfig
from services.common.model_arch import ModelArch

GiB = 1024**3
_ARR = "actor_rollout_ref"
_MODEL_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_FSDP_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def trainer_param_bytes(cfg: MeshConfig) -> int:
    """Bytes per parameter the trainer holds and exports: megatron builds its model in
    `model.dtype`; FSDP in `fsdp_config.model_dtype` when it is set, else `model.dtype`
    (services/trainer/engines/hf_model.master_dtype)."""
    arr = cfg.actor_rollout_ref
    fsdp = arr.actor.fsdp_config
    if arr.actor.strategy not in ("megatron", "mindspeed") and fsdp.model_dtype is not None:
        return _FSDP_DTYPE_BYTES[fsdp.model_dtype]
    return _MODEL_DTYPE_BYTES[arr.model.dtype]


def fsdp_shard_size(cfg: MeshConfig) -> int:
    """Ranks one FSDP shard group spans (services/trainer/engines/dist.build_meshes): the whole
    world for fsdp_size -1 / 0 or >= the world, else fsdp_size (replicated groups beside it)."""
    world = _world(cfg)
    size = cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size
    return world if size <= 0 or size >= world else size


def _world(cfg: MeshConfig) -> int:
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def stage_layers(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int] | None:
    """Layers per pipeline stage (megatron's split), or None when it does not divide."""
    if pp == 1:
        return [num_layers]
    if first is None and last is None:
        return [num_layers // pp] * pp if num_layers % pp == 0 else None
    f = first if first is not None else None
    la = last if last is not None else None
    middle_stages = pp - (f is not None) - (la is not None)
    rest = num_layers - (f or 0) - (la or 0)
    if middle_stages == 0:
        return [f or 0, la or 0] if rest == 0 else None
    if rest < 0 or rest % middle_stages:
        return None
    mid = [rest // middle_stages] * middle_stages
    return ([f] if f is not None else []) + mid + ([la] if la is not None else [])


def stage_params(arch: ModelArch, m: MegatronConfig, resident: bool = False) -> list[tuple[int, int]]:
    """(dense, expert) parameters of each megatron pipeline stage: its layers, the input embedding
    on the first stage, the LM head (0 if tied) and the final norm on the last. `resident`: what
    the stage allocates, i.e. with tied embeddings and PP > 1 the last stage's own copy of the
    embedding as well (exported once, so not counted for weight sync)."""
    pp = m.pipeline_model_parallel_size
    tcfg = m.override_transformer_config
    stages = stage_layers(arch.num_layers, pp, tcfg.get("num_layers_in_first_pipeline_stage"),
                          tcfg.get("num_layers_in_last_pipeline_stage")) or [arch.num_layers // pp] * pp
    counts = arch.param_counts()
    out: list[tuple[int, int]] = []
    start = 0
    for s, n in enumerate(stages):
        dense = sum(arch.layer_params(i)[0] for i in range(start, start + n))
        expert = sum(arch.layer_params(i)[1] for i in range(start, start + n))
        start += n
        if s == 0:
            dense += counts["embedding"]
        if s == pp - 1:
            dense += counts["output"] + arch.hidden_size
            if resident and pp > 1 and arch.tie_word_embeddings:
                dense += counts["embedding"]
        out.append((dense, expert))
    return out


def trainer_checks(cfg: MeshConfig, arch: ModelArch, errors: list[str], warnings: list[str]) -> None:
    arr = cfg.actor_rollout_ref
    actor = arr.actor
    world = _world(cfg)
    n = arr.rollout.n
    strategy = actor.strategy
    remove_padding = arr.model.use_remove_padding or (strategy in ("megatron", "mindspeed") and actor.megatron.use_remove_padding)
    if arch.has_linear_attention and remove_padding:
        errors.append(
            f"{arch.model_type} has gated delta-net (linear attention) layers, which need unpacked bshd batches: "
            f"set {_ARR}.model.use_remove_padding=false"
            + (f" and {_ARR}.actor.megatron.use_remove_padding=false" if strategy in ("megatron", "mindspeed") else "")
        )
    if strategy == "mindspeed" and cfg.trainer.device != "npu":
        errors.append(f"actor.strategy=mindspeed runs on Ascend NPU only: set trainer.device=npu or strategy=megatron (got {cfg.trainer.device})")
    if strategy in ("megatron", "mindspeed"):
        m = actor.megatron
        dp = world // max(1, m.model_parallel_size)
        if world % m.model_parallel_size == 0:
            seqs = actor.ppo_mini_batch_size * n
            if seqs % dp:
                errors.append(
                    f"a mini-batch of {actor.ppo_mini_batch_size} prompts x rollout.n={n} = {seqs} sequences does not split "
                    f"over data-parallel size {dp}; change {_ARR}.actor.ppo_mini_batch_size"
                )
        if arch.model_type not in ("qwen3", "qwen3_moe", "qwen2", "llama"):
            warnings.append(
                f"meshrl's megatron engine maps Qwen3 / Qwen3-MoE weights; {arch.model_type} (gated delta-net, shared experts) "
                "is not implemented there yet, so this recipe validates but cannot train with strategy=megatron"
            )
    else:
        sp = actor.ulysses_sequence_parallel_size
        if world % sp:
            errors.append(f"{_ARR}.actor.ulysses_sequence_parallel_size={sp} does not divide the {world} training devices")
        elif arch.num_attention_heads % sp:
            errors.append(
                f"ulysses_sequence_parallel_size={sp} must divide the {arch.num_attention_heads} attention heads; pick a divisor"
            )
        else:
            dp = world // sp
            seqs = actor.ppo_mini_batch_size * n
            if seqs % dp:
                errors.append(
                    f"a mini-batch of {seqs} sequences does not split over {dp} data-parallel ranks; change ppo_mini_batch_size"
                )
        fsdp_size = actor.fsdp_config.fsdp_size
        if 0 < fsdp_size < world and world % fsdp_size:
            errors.append(f"{_ARR}.actor.fsdp_config.fsdp_size={fsdp_size} does not divide the {world} training devices")


def megatron_layout(cfg: MeshConfig, arch: ModelArch, errors: list[str]) -> dict[str, Any]:
    m = cfg.actor_rollout_ref.actor.megatron
    world = _world(cfg)
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size or tp
    vpp = m.virtual_pipeline_model_parallel_size or 1
    key = f"{_ARR}.actor.megatron"
    if world % (tp * pp * cp):
        errors.append(
            f"{key}: TP({tp}) x PP({pp}) x CP({cp}) = {tp * pp * cp} does not divide the {world} training devices "
            f"(trainer.nnodes x trainer.n_gpus_per_node); change the parallel sizes or the device count"
        )
    per_stage = world // pp if world % pp == 0 else 0
    if arch.is_moe and (not per_stage or per_stage % (etp * ep)):
        errors.append(
            f"{key}: expert_tensor_parallel_size({etp}) x expert_model_parallel_size({ep}) = {etp * ep} does not divide the "
            f"{per_stage or world / pp} devices of a pipeline stage; change EP or ETP"
        )
    if arch.is_moe and arch.num_experts % ep:
        errors.append(f"{key}.expert_model_parallel_size={ep} does not divide the model's {arch.num_experts} experts")
    if not arch.is_moe and ep > 1:
        errors.append(f"{key}.expert_model_parallel_size={ep} > 1 but {arch.model_type} has no experts; set it to 1")
    if arch.num_attention_heads % tp:
        errors.append(f"{key}.tensor_model_parallel_size={tp} must divide the {arch.num_attention_heads} attention heads")
    if arch.num_key_value_heads % tp:
        errors.append(f"{key}.tensor_model_parallel_size={tp} must divide the {arch.num_key_value_heads} key/value heads")
    tcfg = m.override_transformer_config
    first, last = tcfg.get("num_layers_in_first_pipeline_stage"), tcfg.get("num_layers_in_last_pipeline_stage")
    stages = stage_layers(arch.num_layers, pp, first, last)
    if stages is None:
        errors.append(
            f"{key}: {arch.num_layers} layers do not split over {pp} pipeline stages"
            + (f" with {first} in the first and {last} in the last stage" if first or last else "")
            + "; set override_transformer_config.num_layers_in_first_pipeline_stage / _last_ or change PP"
        )
    elif vpp > 1 and any(s % vpp for s in stages):
        errors.append(f"{key}.virtual_pipeline_model_parallel_size={vpp} must divide every stage's layers {stages}")
    if vpp > 1 and pp == 1:
        errors.append(f"{key}.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1")
    dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else None
    expert_dp = per_stage // (etp * ep) if arch.is_moe and per_stage and per_stage % (etp * ep) == 0 else None
    return {
        "tensor_parallel": tp, "pipeline_parallel": pp, "virtual_pipeline_parallel": vpp, "context_parallel": cp,
        "expert_parallel": ep, "expert_tensor_parallel": etp, "data_parallel": dp, "expert_data_parallel": expert_dp,
        "layers_per_stage": stages, "sequence_parallel": m.sequence_parallel and tp > 1,
        "distributed_optimizer": m.use_distributed_optimizer,
    }


def rollout_parallel(cfg: MeshConfig) -> dict[str, tuple[str, int]]:
    """One rollout engine's TP, DP and PP as the engine runs them, each as (the key that sets it,
    size). vllm_args.py passes actor_rollout_ref.rollout's sizes and then engine_kwargs.vllm over
    them, so a size given there is the one vLLM runs with: every check and number of the rollout's
    layout reads the sizes here (reading the top-level key let an engine that cannot split the
    heads, or fit the devices, pass). The transformers engine is one device."""
    r = cfg.actor_rollout_ref.rollout
    if r.name != "vllm":
        # The transformers engine runs on one device and reads no parallel size: a verl TP left in
        # its config made the plan split the pool into TP-device engines and check heads it never splits
        # (as the auto-filled Serve sizing, resolve.py _serve_rollout_sizing, counts it).
        one = (f"{_ARR}.rollout.name", 1)
        return {"tp": one, "dp": one, "pp": one}
    return r.vllm_parallel()


def rollout_expert_parallel(cfg: MeshConfig) -> tuple[str, int]:
    """One rollout engine's expert-parallel size as vLLM runs it, with the key that sets it. vLLM
    has no EP size: enable_expert_parallel spreads the experts over the engine's TP x DP ranks;
    vllm_args.py turns it on for expert_parallel_size > 1 and passes engine_kwargs.vllm's flag
    over that (the plan read expert_parallel_size alone: 1 with the flag set there planned
    TP-sharded experts where vLLM ran EP 64, 8x the expert weights per device)."""
    r = cfg.actor_rollout_ref.rollout
    if r.name != "vllm":
        return f"{_ARR}.rollout.name", 1
    vllm = r.engine_kwargs.get("vllm", {})
    if "enable_expert_parallel" in vllm:
        key, on = f"{_ARR}.rollout.engine_kwargs.vllm.enable_expert_parallel", bool(vllm["enable_expert_parallel"])
    else:
        key, on = f"{_ARR}.rollout.expert_parallel_size", r.expert_parallel_size > 1
    sizes = rollout_parallel(cfg)
    return key, sizes["tp"][1] * sizes["dp"][1] if on else 1


def rollout_engine_devices(cfg: MeshConfig) -> int:
    """Devices one rollout engine spans: TP x DP x PP (rollout_parallel)."""
    sizes = rollout_parallel(cfg)
    return sizes["tp"][1] * sizes["dp"][1] * sizes["pp"][1]


def rollout_engine_spans_nodes(cfg: MeshConfig) -> bool:
    """Whether one vLLM engine is larger than a node (rollout.n_gpus_per_node): its Serve replica
    then reserves no device, and vLLM's Ray executor places the engine's workers over whole nodes
    (verl's RolloutReplica: rollout.n_gpus_per_node workers on each of TP x DP x PP / that nodes)."""
    return cfg.actor_rollout_ref.rollout.name == "vllm" and rollout_engine_devices(cfg) > cfg.rollout.n_gpus_per_node


def rollout_node_mismatch(cfg: MeshConfig) -> str | None:
    """Why the vLLM engines of TP x DP x PP do not tile the rollout's nodes, or None. An engine
    within a node is one Serve replica placed on one node, so it must divide
    rollout.n_gpus_per_node: 2 nodes of 6 in engines of 4 made 3 replicas of which one fits a
    node each, the third waited unplaced for ever (and 2 devices a node ran nothing). An engine
    larger than a node spans whole nodes (rollout_engine_spans_nodes)."""
    if cfg.actor_rollout_ref.rollout.name != "vllm":
        return None
    per_node = cfg.rollout.n_gpus_per_node
    engine = rollout_engine_devices(cfg)
    parts = _engine_parts(rollout_parallel(cfg))
    if engine > per_node and engine % per_node:
        return (f"{parts} = {engine} devices per engine is more than the rollout.n_gpus_per_node={per_node} devices of "
                f"a node but no whole number of nodes: an engine spanning nodes takes all the devices of each of its "
                f"nodes; make the engine's devices a multiple of {per_node} (or a divisor of it), or change "
                f"rollout.n_gpus_per_node")
    if engine <= per_node and per_node % engine:
        return (f"{parts} = {engine} devices per engine does not divide the rollout.n_gpus_per_node={per_node} devices "
                f"of a node: under Serve each engine is one rollout replica on one node, so a node holds "
                f"{per_node // engine} of them and {per_node % engine} of its devices run no engine, and the replicas "
                f"past that wait unplaced; make the engine's devices a divisor of {per_node}, or "
                f"rollout.n_gpus_per_node a multiple of {engine}")
    return None


def _engine_parts(sizes: dict[str, tuple[str, int]]) -> str:
    """"key(TP) x key(DP)[ x key(PP)]" for messages, each size under the key that sets it."""
    parts = [f"{key}({n})" for name, (key, n) in sizes.items() if name != "pp" or n > 1]
    return " x ".join(parts)


def _reserved(app: Any, section: str) -> tuple[str, float]:
    """The devices a Serve deployment's replica reserves, with the key that sets them: num_gpus,
    else resources NPU (0: none)."""
    if app.num_gpus:
        return f"{section}.num_gpus", app.num_gpus
    return f"{section}.resources.NPU", float(app.resources.get("NPU", 0))


def serve_rollout_devices_mismatch(cfg: MeshConfig) -> str | None:
    """Why each Serve rollout replica's devices (serve.rollout.num_gpus, or resources NPU) do not fit
    the vLLM engine it starts, or None. One replica runs one AsyncLLM over TP x PP x DP devices
    (engine_kwargs.vllm overrides included, as vllm_args.py passes them): given fewer, vLLM sees
    too few devices, falls back to its Ray executor and places the missing workers in a placement
    group of its own, on devices outside the replica's allocation (or waits for ever on a full
    cluster); given more, the rest sit idle. 0 devices is left alone (no device reservation: a CPU
    run, or devices shared on purpose)."""
    r = cfg.actor_rollout_ref.rollout
    if r.name != "vllm":
        return None
    app = cfg.serve.rollout
    key, count = _reserved(app, "serve.rollout")
    if not count:
        return None
    sizes = rollout_parallel(cfg)
    engine = rollout_engine_devices(cfg)
    parts = _engine_parts(sizes)
    per_node = cfg.rollout.n_gpus_per_node
    if engine > per_node:
        # No replica can reserve a whole engine (no node has the devices: it waited unplaced for
        # ever); vLLM's Ray executor places the engine's workers over nodes in a placement group of
        # its own, which cannot use devices reserved for the replica.
        pool = cfg.rollout.nnodes * per_node
        replicas = f" and serve.rollout.num_replicas={pool // engine}" if pool % engine == 0 else ""
        # a pool smaller than one engine: rollout.n_gpus_per_node (default 1) likely undercounts a node
        node = (f" (or, where a node has the {engine} devices, set rollout.n_gpus_per_node to its device count and "
                f"set {key}={engine})" if pool < engine else "")
        return (f"{key}={count:g} but each rollout replica runs one vLLM engine of {parts} = {engine} devices, more "
                f"than the rollout.n_gpus_per_node={per_node} of a node: no node can hold such a reservation, and vLLM's "
                f"Ray executor places the engine's workers over nodes in a placement group of its own, which devices "
                f"reserved for the replica are kept from; set {key}=0{replicas}{node}")
    if count == engine or (engine == 1 and count < 1):  # a fraction of one device: replicas share it
        return None
    effect = ("vLLM places the missing workers on devices outside the replica's allocation, or waits for them"
              if count < engine else f"{count - engine:g} of them sit idle")
    return (f"{key}={count:g} but each rollout replica runs one vLLM engine of {parts} = {engine} devices: "
            f"{effect}; set {key}={engine} (or change the engine's parallel sizes)")


def serve_rollout_pool_mismatch(cfg: MeshConfig) -> str | None:
    """Why the devices the Serve rollout replicas take (replicas x serve.rollout.num_gpus, or
    resources NPU) are not the rollout.nnodes x rollout.n_gpus_per_node the config asks for, or
    None. A verl config sizes the rollout with those two keys and gets that many devices, in
    engines of TP x DP x PP; under Serve the replicas are what run, so with fewer devices the run
    had fewer engines than asked (the rest idle on the cluster sized for it), with more the
    replicas past the pool waited unplaced on such a cluster. 0 devices per replica is left alone
    (no reservation: a CPU run, or devices shared on purpose; serve_rollout_devices_mismatch),
    except for an engine larger than a node, whose devices vLLM takes whatever the replica reserves;
    the pool is the most an autoscaling rollout grows to."""
    app = cfg.serve.rollout
    key, count = _reserved(app, "serve.rollout")
    pool = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    rkey, replicas = (("serve.rollout.num_replicas", app.num_replicas) if app.autoscaling is None
                      else ("serve.rollout.autoscaling.max_replicas", app.autoscaling.max_replicas))
    if rollout_engine_spans_nodes(cfg):
        # each replica's engine takes its devices through vLLM's own placement group, whatever the
        # replica reserves (serve_rollout_devices_mismatch): one replica left half of 2 engines' pool idle
        key, count = _engine_parts(rollout_parallel(cfg)), rollout_engine_devices(cfg)
    if not count:
        return None
    used = math.ceil(round(replicas * count, 6))  # replicas given a fraction of a device share it
    if used == pool:
        return None
    effect = (f"{pool - used} of the devices asked for run no engine" if used < pool
              else f"the rollout takes {used - pool} device(s) more than asked for, and on a cluster sized for the "
                   "run the replicas past them wait unplaced")
    want = pool / count
    fix = f"set {rkey}={int(want)} or " if want >= 1 and want.is_integer() else "set "
    return (f"rollout.nnodes x rollout.n_gpus_per_node = {pool} rollout devices but {rkey}={replicas} x "
            f"{key}={count:g} = {used}: {effect}; {fix}rollout.nnodes x rollout.n_gpus_per_node to {used}")


def serve_trainer_devices_reserved(cfg: MeshConfig) -> str | None:
    """Why serve.trainer's devices (num_gpus, or resources NPU) are wrong, or None. The trainer's
    Serve replica only drives its ranks, which take trainer.nnodes x trainer.n_gpus_per_node
    devices of their own, one a rank, in a placement group (services/trainer/ranks.py spawn): a
    device reserved for the replica is never trained on, and on a cluster sized for the run it
    is the one the ranks' placement group lacks, so the trainer waits for it until it times out."""
    app = cfg.serve.trainer
    key, count = _reserved(app, "serve.trainer")
    if not count:
        return None
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    return (f"{key}={count:g} reserves devices for the trainer's driver replica, which trains on none: its "
            f"trainer.nnodes x trainer.n_gpus_per_node = {world} ranks take one device each in a placement group "
            f"of their own, so these sit idle and can keep that group from being placed; set {key}=0 (size the "
            f"trainer with trainer.n_gpus_per_node, place the replica with serve.trainer.resources)")


def serve_launch_problems(cfg: MeshConfig) -> list[str]:
    """What keeps this config's Serve deployment from working, though the config itself loads
    (rollouts run outside Serve set their own devices and receivers): `meshrl train` and
    serve-config refuse it, `meshrl plan` lists it among its errors."""
    from services.weights.transports import serve_receivers_mismatch

    checks = (serve_receivers_mismatch, rollout_node_mismatch, serve_rollout_devices_mismatch,
              serve_rollout_pool_mismatch, serve_trainer_devices_reserved)
    return [problem for check in checks if (problem := check(cfg))]


def rollout_checks(cfg: MeshConfig, arch: ModelArch, errors: list[str], warnings: list[str]) -> None:
    devices = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    sizes = rollout_parallel(cfg)
    engine = rollout_engine_devices(cfg)
    if devices % engine:
        errors.append(
            f"{_engine_parts(sizes)} = {engine} devices per engine does not divide the {devices} rollout devices "
            "(rollout.nnodes x rollout.n_gpus_per_node)"
        )
    tp_key, tp = sizes["tp"]
    if arch.num_attention_heads % tp:
        errors.append(f"{tp_key}={tp} must divide the {arch.num_attention_heads} attention heads")
    kv = arch.num_key_value_heads
    if kv % tp and tp % kv:
        errors.append(f"{tp_key}={tp} and the {kv} key/value heads must divide one another")
    ep_key, ep = rollout_expert_parallel(cfg)  # TP x DP when on: load refuses another expert_parallel_size
    if ep > 1:
        if not arch.is_moe:
            errors.append(f"{ep_key} turns on vLLM's expert parallelism but {arch.model_type} has no experts; turn it off")
        elif arch.num_experts % ep:
            errors.append(f"{ep_key}: vLLM's expert parallelism over TP x DP = {ep} ranks does not divide the "
                          f"model's {arch.num_experts} experts")


def memory_estimate(cfg: MeshConfig, arch: ModelArch) -> dict[str, Any]:
    """Per-rank at-rest bytes of parameters, gradients and optimizer state, and where they live."""
    actor = cfg.actor_rollout_ref.actor
    world = _world(cfg)
    if actor.strategy in ("megatron", "mindspeed"):
        m = actor.megatron
        tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
        ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size or tp
        dp = max(1, world // (tp * pp * cp))
        edp = max(1, world // (pp * etp * ep))
        p_bytes = trainer_param_bytes(cfg)
        opt_bytes = 8 if p_bytes == 4 else 12  # fp32 params are their own master copy
        worst: dict[str, float] = {}
        for s, (dense, expert) in enumerate(stage_params(arch, m, resident=True)):
            dense_rank, expert_rank = dense / tp, expert / (etp * ep)
            opt_div_dense = dp * cp if m.use_distributed_optimizer else 1
            opt_div_expert = edp if m.use_distributed_optimizer else 1
            stage = {
                "stage": s,
                "params": dense_rank + expert_rank,
                "param_bytes": p_bytes * (dense_rank + expert_rank),
                "grad_bytes": 4 * (dense_rank + expert_rank),
                "optimizer_bytes": opt_bytes * (dense_rank / opt_div_dense + expert_rank / opt_div_expert),
            }
            if not worst or stage["param_bytes"] + stage["grad_bytes"] + stage["optimizer_bytes"] > (
                worst["param_bytes"] + worst["grad_bytes"] + worst["optimizer_bytes"]
            ):
                worst = stage
        offload = {"params": m.param_offload, "grads": m.grad_offload, "optimizer": m.optimizer_offload}
        assumptions = (f"{cfg.actor_rollout_ref.model.dtype} params, fp32 grads, fp32 Adam "
                       f"{'m+v' if p_bytes == 4 else 'master+m+v'}; largest pipeline stage")
    else:
        f = actor.fsdp_config
        shard = fsdp_shard_size(cfg)
        p_bytes = trainer_param_bytes(cfg)
        total = arch.total_params / shard
        worst = {
            "stage": 0, "params": total, "param_bytes": p_bytes * total, "grad_bytes": p_bytes * total,
            "optimizer_bytes": 2 * p_bytes * total,  # torch AdamW: m and v in the parameters' dtype
        }
        offload = {"params": f.param_offload, "grads": f.param_offload, "optimizer": f.optimizer_offload}
        dtype = "fp32" if p_bytes == 4 else "bf16"
        assumptions = f"{dtype} params and grads, Adam m+v in {dtype} (no separate master), sharded over {shard} ranks"
    device = sum(worst[k] for k, kind in (("param_bytes", "params"), ("grad_bytes", "grads"), ("optimizer_bytes", "optimizer"))
                 if not offload[kind])
    host = sum(worst[k] for k, kind in (("param_bytes", "params"), ("grad_bytes", "grads"), ("optimizer_bytes", "optimizer"))
               if offload[kind])
    per_rank = {k: int(v) for k, v in worst.items()}
    return {
        "trainer_per_rank": {
            **per_rank,
            "param_gib": round(worst["param_bytes"] / GiB, 2),
            "grad_gib": round(worst["grad_bytes"] / GiB, 2),
            "optimizer_gib": round(worst["optimizer_bytes"] / GiB, 2),
            "device_at_rest_gib": round(device / GiB, 2),
            "host_at_rest_gib": round(host / GiB, 2),
            "offload": offload,
            "assumptions": assumptions,
        },
        "rollout_weights_per_device_gib": round(_rollout_weight_bytes(cfg, arch) / GiB, 2),
    }


def _rollout_weight_bytes(cfg: MeshConfig, arch: ModelArch) -> float:
    r = cfg.actor_rollout_ref.rollout
    counts = arch.param_counts()
    dense = counts["embedding"] + counts["output"] + counts["dense"]
    bytes_per = 4 if r.dtype == "float32" else 2
    sizes = rollout_parallel(cfg)
    tp, pp = sizes["tp"][1], sizes["pp"][1]
    # expert parallelism holds whole experts over TP x DP ranks; without it, TP shards each expert
    ep = rollout_expert_parallel(cfg)[1]
    experts_split = ep if ep > 1 else tp
    return bytes_per * (dense / tp + counts["expert"] / experts_split) / pp
