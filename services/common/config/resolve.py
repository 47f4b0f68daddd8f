"""From what a config file says to what the tree holds, before validation.

A config is written in verl's layout (a verl launch script translates line by line) plus meshrl's
sections, and earlier meshrl spellings stay accepted. `resolve_tree` maps such an input onto the
sections the services read, as a new mapping: verl's aliases (`rollout.n`), what a mode implies
(`async_training.mode=sync`), defaults that depend on another section
(`loss_scale_factor`, the Serve rollout replicas), moved keys (`LEGACY_KEYS`), and the sections a service reads
that verl's keys fill (`LOOP_KEYS`). It runs as MeshConfig's `before`
validator, so YAML, dotted overrides, a Serve application's args and a resolved config all go
through it; a resolved config passes through unchanged. Validation afterwards only checks.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from .actor_rollout_ref import ActorConfig, CheckpointEngineConfig, RolloutEngineConfig
from .algorithm import FilterGroupsConfig, RolloutCorrectionConfig
from .async_training import AsyncTrainingConfig
from .data import DataConfig
from .rollout_worker import RolloutWorkerConfig
from .trainer import RolloutResourcesConfig, TrainerConfig

LEGACY_KEYS: dict[str, str] = {
    "trainer_service.worker_nice": "tuning.nice.trainer_ranks",
    "serve.ray_nice": "tuning.nice.ray_daemons",
    **{f"serve.{app}.nice": f"tuning.nice.{app}" for app in ("coordinator", "rollout", "reward", "param_server", "trainer")},
}
"""Old dotted key -> where it lives now. Either spelling is accepted; both at once must agree."""

LOOP_SECTION = "trainer_service.loop"
"""The trainer loop's section: derived from `LOOP_KEYS`, never input."""

LOOP_KEYS: dict[str, tuple[str, type[BaseModel]]] = {
    "ppo_mini_batch_size": ("actor_rollout_ref.actor.ppo_mini_batch_size", ActorConfig),
    "require_batches": ("async_training.require_batches", AsyncTrainingConfig),
    "trigger_parameter_sync_step": ("async_training.trigger_parameter_sync_step", AsyncTrainingConfig),
    "ppo_epochs": ("actor_rollout_ref.actor.ppo_epochs", ActorConfig),
    "shuffle": ("actor_rollout_ref.actor.shuffle", ActorConfig),
    "use_kl_loss": ("actor_rollout_ref.actor.use_kl_loss", ActorConfig),
    "temperature": ("actor_rollout_ref.rollout.temperature", RolloutEngineConfig),
    "update_weights_bucket_megabytes": (
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes", CheckpointEngineConfig,
    ),
    "total_rollout_steps": ("rollout.total_rollout_steps", RolloutResourcesConfig),
    "total_epochs": ("rollout.total_epochs", RolloutResourcesConfig),
    "total_training_steps": ("trainer.total_training_steps", TrainerConfig),
    "save_freq": ("trainer.save_freq", TrainerConfig),
    "default_local_dir": ("trainer.default_local_dir", TrainerConfig),
    "resume_mode": ("trainer.resume_mode", TrainerConfig),
    "resume_from_path": ("trainer.resume_from_path", TrainerConfig),
    "seed": ("trainer.seed", TrainerConfig),
    "bypass_mode": ("algorithm.rollout_correction.bypass_mode", RolloutCorrectionConfig),
    "filter_metric": ("algorithm.filter_groups.metric", FilterGroupsConfig),
    "max_num_gen_batches": ("algorithm.filter_groups.max_num_gen_batches", FilterGroupsConfig),
}
"""`trainer_service.loop.<field>` -> (the verl key it is copied from, that key's section)."""

_MISSING = object()


def _plain(node: Any) -> Any:
    """A deep copy with models turned into the mappings they were built from."""
    if isinstance(node, BaseModel):
        node = node.model_dump(exclude_unset=True)
    if isinstance(node, Mapping):
        return {k: _plain(v) for k, v in node.items()}
    return copy.deepcopy(node)


def _get(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            return  # not a section: validation reports it
        node = child
    node[leaf] = value


def _pop(tree: dict[str, Any], key: str) -> Any:
    *parents, leaf = key.split(".")
    parent = _get(tree, ".".join(parents)) if parents else tree
    if not isinstance(parent, dict) or leaf not in parent:
        return _MISSING
    return parent.pop(leaf)


def _given(tree: dict[str, Any], key: str) -> bool:
    return _get(tree, key) is not _MISSING


def _value(tree: dict[str, Any], key: str, model: type[BaseModel]) -> Any:
    """The value at `key`, or its field's default in `model` when absent."""
    value = _get(tree, key)
    return model.model_fields[key.rsplit(".", 1)[-1]].default if value is _MISSING else value


def legacy_keys_in(tree: Mapping[str, Any]) -> dict[str, str]:
    """{new key: old key} for every old spelling `tree` uses (for error messages)."""
    plain = _plain(tree)
    return {new: old for old, new in LEGACY_KEYS.items() if _given(plain, old)}


def resolve_tree(data: Any) -> Any:
    """The input with verl's layout and old spellings resolved (a new mapping; `data` is not
    changed). Raises ValueError, naming the keys and the fix, where two spellings disagree."""
    if not isinstance(data, Mapping):
        return data
    tree: dict[str, Any] = _plain(data)
    _move_legacy(tree)
    _rollout_n(tree)
    _total_epochs(tree)
    _sync_mode(tree)
    _loss_scale_factor(tree)
    _serve_rollout_sizing(tree)
    _trainer_loop(tree)
    return tree


def _move_legacy(tree: dict[str, Any]) -> None:
    for old, new in LEGACY_KEYS.items():
        value = _pop(tree, old)
        if value is _MISSING:
            continue
        current = _get(tree, new)
        if current is not _MISSING and current != value:
            raise ValueError(f"{old}={value} and {new}={current} disagree; {old} is the old spelling of {new}: keep one")
        _set(tree, new, value)


def _stands_for(tree: dict[str, Any], key: str, target: str) -> None:
    """KEY (verl's spelling) stands for TARGET (what meshrl reads) when TARGET is not given, and
    must equal it when it is; a null KEY says nothing."""
    value = _get(tree, key)
    if value is _MISSING or value is None:
        return
    inner = _get(tree, target)
    if inner is _MISSING:
        _set(tree, target, value)
    elif inner != value:
        raise ValueError(f"{key}={value} disagrees with {target}={inner}; set one of them")


def _rollout_n(tree: dict[str, Any]) -> None:
    """verl fully async scripts set the top-level `rollout.n`."""
    _stands_for(tree, "rollout.n", "actor_rollout_ref.rollout.n")


def _total_epochs(tree: dict[str, Any]) -> None:
    """verl fully async caps the run with `trainer.total_epochs`; meshrl reads `rollout.total_epochs`."""
    _stands_for(tree, "trainer.total_epochs", "rollout.total_epochs")


_MODE_IMPLIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "sync": ("is on-policy lock-step", {"staleness_threshold": 0.0, "trigger_parameter_sync_step": 1}, {}),
    "one_step_off": (
        "generates each batch with the previous version's weights",
        {"staleness_threshold": 1.0, "trigger_parameter_sync_step": 1},
        {"partial_rollout": False, "max_staleness_versions": 1},
    ),
}
"""async_training.mode -> (what it means, keys it needs, keys it fills when unset), as `meshrl train
--mode` sets them (meshrl/train.py MODE_OVERRIDES)."""


def _sync_mode(tree: dict[str, Any]) -> None:
    """`sync` (staleness_threshold 0, trigger_parameter_sync_step 1) and `one_step_off` (1 and 1,
    no partial rollout, max_staleness_versions 1): unset keys are filled in, a given key that
    contradicts the mode is an error. Without this a mode written in the config ran with the fully
    async defaults under the mode's name."""
    mode = _value(tree, "async_training.mode", AsyncTrainingConfig)
    if mode not in _MODE_IMPLIES:
        return
    meaning, needs, fills = _MODE_IMPLIES[mode]
    keys = {f"async_training.{k}": v for k, v in needs.items()}
    wrong = [k for k, v in keys.items() if _given(tree, k) and _get(tree, k) != v]
    if wrong:
        want = " and ".join(f"{k}={v}" for k, v in needs.items())
        raise ValueError(
            f"async_training.mode={mode} {meaning}: it needs {want} (or leave them unset); "
            f"got {', '.join(f'{k}={_get(tree, k)}' for k in wrong)}"
        )
    for k, v in {**keys, **{f"async_training.{k}": v for k, v in fills.items()}}.items():
        if not _given(tree, k):
            _set(tree, k, v)


def _loss_scale_factor(tree: dict[str, Any]) -> None:
    """verl divides seq-mean-token-sum-norm by the padded response length; meshrl pads per
    micro-batch, so the constant is fixed once: data.max_response_length (Dr.GRPO's "generation
    budget")."""
    key = "actor_rollout_ref.actor.loss_scale_factor"
    if _value(tree, "actor_rollout_ref.actor.loss_agg_mode", ActorConfig) != "seq-mean-token-sum-norm":
        return
    if _get(tree, key) in (_MISSING, None):
        _set(tree, key, _value(tree, "data.max_response_length", DataConfig))


_SERVE_ROLLOUT_SIZING = ("serve.rollout.num_gpus", "serve.rollout.resources.NPU", "serve.rollout.num_replicas",
                         "serve.rollout.autoscaling")
"""The keys that size the Serve rollout replicas: one given, the user sized them."""


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _serve_rollout_sizing(tree: dict[str, Any]) -> None:
    """A verl config sizes the rollout with rollout.nnodes x rollout.n_gpus_per_node devices, run
    as engines of TP x DP x PP (vLLM's sizes: engine_kwargs.vllm over the top-level ones, as
    vllm_args.py passes them); under Serve only the rollout replicas run, and the defaults (one
    replica, no device reserved) ran one engine, placed by Ray on any device, the trainer's
    included, while the rest of the pool sat idle. When the rollout runs on accelerators (vLLM, or
    rollout_worker.device cuda / npu; the kind: rollout_worker.device, else verl's trainer.device,
    the device of all its workers) and no key of `_SERVE_ROLLOUT_SIZING` is given, each engine
    becomes one replica owning its devices: serve.rollout.num_gpus (resources NPU on npu) = the
    engine's devices, serve.rollout.num_replicas = pool / that. A device kind of `auto` is decided
    on the replica, after load: left alone. A vLLM engine larger than a node spans whole nodes
    through vLLM's Ray executor: its replica reserves no device, num_replicas = pool / engine. An
    engine that does not tile the nodes is refused naming the keys."""
    if any(_given(tree, key) for key in _SERVE_ROLLOUT_SIZING):
        return
    if any(_get(tree, key) is not _MISSING and not isinstance(_get(tree, key), dict) for key in ("serve", "serve.rollout")):
        return  # not a section: validation reports it
    name = _value(tree, "actor_rollout_ref.rollout.name", RolloutEngineConfig)
    worker = _value(tree, "rollout_worker.device", RolloutWorkerConfig)
    kind = worker if worker in ("cuda", "npu") else (
        _value(tree, "trainer.device", TrainerConfig) if name == "vllm" and worker == "auto" else None)
    if kind not in ("cuda", "npu"):
        return
    vllm = _get(tree, "actor_rollout_ref.rollout.engine_kwargs.vllm") if name == "vllm" else {}
    vllm = vllm if isinstance(vllm, dict) else {}
    # (the key that sets it, size), as meshrl/plan_layout.py rollout_parallel reads them; PP only in engine_kwargs.vllm.
    # The transformers engine runs on one device and reads no parallel size: a verl TP left in its
    # config reserved that many devices per replica (all but one idle), or refused a pool it did not divide.
    sizes: list[tuple[str, int | None]] = []
    parallel = (("tensor_parallel_size", "tensor_model_parallel_size"), ("data_parallel_size", "data_parallel_size"),
                ("pipeline_parallel_size", None)) if name == "vllm" else ()
    for vllm_key, key in parallel:
        if vllm_key in vllm:
            sizes.append((f"actor_rollout_ref.rollout.engine_kwargs.vllm.{vllm_key}", _whole(vllm[vllm_key])))
        elif key is not None:
            top = f"actor_rollout_ref.rollout.{key}"
            sizes.append((top, _whole(_value(tree, top, RolloutEngineConfig))))
    per_node = _whole(_value(tree, "rollout.n_gpus_per_node", RolloutResourcesConfig))
    nnodes = _whole(_value(tree, "rollout.nnodes", RolloutResourcesConfig))
    if per_node is None or nnodes is None or any(n is None for _, n in sizes):
        return  # validation names the bad value
    engine = math.prod(n for _, n in sizes if n is not None)
    parts = " x ".join(f"{key}({n})" for key, n in sizes)
    pool = nnodes * per_node
    if engine > per_node:  # vLLM only: the transformers engine is one device
        # vLLM spans nodes with its Ray executor, whose placement group takes the engine's devices
        # (whole nodes, as verl places them): the replica reserves none, one replica per engine
        # (left as one replica, a pool of 2 engines ran 1 and half its devices idle)
        if engine % per_node or pool % engine:
            # A pool smaller than one engine is most often verl's default of 1 device a node left
            # as it was (vLLM TP 2 on a 2-GPU box): say that first.
            small = (f"the rollout pool, rollout.nnodes x rollout.n_gpus_per_node = {pool}, is smaller than one engine; "
                     f"set rollout.n_gpus_per_node to the devices a node gives the rollout (e.g. rollout.n_gpus_per_node="
                     f"{engine}). Else: " if pool < engine else "")
            raise ValueError(
                f"{small}{parts} = {engine} devices per engine span nodes of rollout.n_gpus_per_node={per_node}, and an "
                f"engine spanning nodes takes whole nodes, and each engine is one rollout replica; make the engine's "
                f"devices a multiple of {per_node} (or a divisor of it) and rollout.nnodes x rollout.n_gpus_per_node = "
                f"{pool} a multiple of them (or change the engine's parallel sizes)"
            )
        _set(tree, "serve.rollout.num_replicas", pool // engine)
        return
    if per_node % engine:
        # each replica is placed on one node: 2 nodes of 6 in engines of 4 made 3 replicas, one a
        # node, the third waiting unplaced for ever
        raise ValueError(
            f"rollout.n_gpus_per_node = {per_node} devices a node are no whole number of engines of {parts} = "
            f"{engine} devices, and under Serve each engine is one rollout replica on one node; make "
            f"rollout.n_gpus_per_node a multiple of {engine} (or change the engine's parallel sizes)"
        )
    _set(tree, "serve.rollout.num_gpus" if kind == "cuda" else "serve.rollout.resources.NPU", engine)
    _set(tree, "serve.rollout.num_replicas", pool // engine)


def _trainer_loop(tree: dict[str, Any]) -> None:
    """Fill `trainer_service.loop` from verl's keys (runs last: `sync` mode fills one of them).
    Values are copied as given; their own sections validate them. The section is derived, so
    input that sets it is refused with the verl key to set instead (a dumped config leaves it
    out: trainer_service.loop is excluded from dumps)."""
    given = _get(tree, LOOP_SECTION)
    if given is not _MISSING:
        fixes = [
            f"set {LOOP_KEYS[f][0]}={value!r} instead of {LOOP_SECTION}.{f}" if f in LOOP_KEYS
            else f"{LOOP_SECTION}.{f} is no key of it"
            for f, value in sorted(given.items() if isinstance(given, dict) else [], key=lambda kv: str(kv[0]))
        ]
        raise ValueError(
            f"{LOOP_SECTION} is not input: it is filled from verl's keys at load; remove it"
            + "".join(f"; {fix}" for fix in fixes)
        )
    if not isinstance(tree.get("trainer_service", {}), dict):
        return  # not a section: validation reports it
    _set(tree, LOOP_SECTION, {field: _value(tree, key, model) for field, (key, model) in LOOP_KEYS.items()})
