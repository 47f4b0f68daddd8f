"""LoRA for the `fsdp` engine (actor_rollout_ref.model.lora_rank > 0), with the `peft` library.

    build      the base model is built as for full training, then wrapped by peft
               (`get_peft_model`, or `PeftModel.from_pretrained(lora_adapter_path)`); only the
               adapter's parameters require gradients, the optimizer sees only them, and FSDP2
               shards base and adapter alike (frozen and trainable parameters may share a unit).
    reference  the base with the adapter disabled (`disable_adapter()`): no second model copy, as
               verl does; the KL term then measures how far the adapter moved the policy.
    export     a weight version is the adapter alone: its descriptor (services/weights/adapter.py:
               base identity, rank, alpha, targets, peft's config) and the lora_A / lora_B tensors
               under PEFT's saved names.
    save       checkpoints hold the adapter and its optimizer state only (the base comes from
               actor_rollout_ref.model.path again); the HF export is a PEFT adapter directory and,
               with `lora_export_merged`, the merged model under `merged/`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from services.common.config.actor_rollout_ref import ModelConfig
from services.common.errors import ConfigError, MissingDependency
from services.weights.adapter import AdapterSpec, descriptor, saved_name

if TYPE_CHECKING:
    from .fsdp import FSDPEngine

ADAPTER_NAME = "default"


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency(
            "LoRA training (actor_rollout_ref.model.lora_rank > 0)", f"install meshrl[lora] (peft); {exc}"
        ) from exc
    return peft


def lora_config(model_cfg: ModelConfig) -> Any:
    """peft's LoraConfig from actor_rollout_ref.model (verl's key names)."""
    peft = _peft()
    return peft.LoraConfig(
        r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, target_modules=model_cfg.target_modules,
        exclude_modules=model_cfg.exclude_modules, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )


def wrap(model: Any, model_cfg: ModelConfig) -> Any:
    """The base model wrapped by peft, adapter trainable, base frozen."""
    peft = _peft()
    path = model_cfg.lora_adapter_path
    if path is None:
        return peft.get_peft_model(model, lora_config(model_cfg))
    saved = peft.PeftConfig.from_pretrained(path)
    if int(saved.r) != model_cfg.lora_rank:
        raise ConfigError(
            f"actor_rollout_ref.model.lora_adapter_path={path} has rank {saved.r} but "
            f"actor_rollout_ref.model.lora_rank={model_cfg.lora_rank}; set lora_rank={saved.r}"
        )
    return peft.PeftModel.from_pretrained(model, path, is_trainable=True)


def trainable(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _json_safe(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value.value) if hasattr(value, "value") else str(value)


def spec_of(model: Any, base_model: str, base_path: str | None) -> AdapterSpec:
    """The descriptor of `model`'s adapter (peft's resolved config)."""
    cfg = model.peft_config[ADAPTER_NAME]
    doc = _json_safe(cfg.to_dict())
    doc["base_model_name_or_path"] = base_path
    targets = cfg.target_modules
    resolved = tuple(sorted(targets)) if isinstance(targets, (set, frozenset, list, tuple)) else (str(targets),)
    return AdapterSpec(base_model=base_model, rank=int(cfg.r), alpha=float(cfg.lora_alpha),
                       target_modules=resolved, peft_config=doc)


def export(engine: FSDPEngine) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter version: descriptor first, then full lora tensors under PEFT's saved names.
    Every rank iterates (gathering sharded parameters is collective); rank 0 yields."""
    if engine.rank == 0:
        yield descriptor(engine.adapter_spec())
    for name, param in trainable(engine.model):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if engine.rank == 0:
            yield saved_name(name, ADAPTER_NAME), full.detach().to("cpu", copy=True)


def save_adapter(engine: FSDPEngine, path: Path, *, merged: bool) -> None:
    """A PEFT adapter directory at `path` (peft's adapter_config.json, adapter_model.safetensors)
    and, with `merged`, the base with the adapter merged in at `path/merged` (plain HF)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    tensors = list(export(engine))[1:]  # every rank iterates (collective); rank 0 gets the tensors
    full = None
    if merged:
        full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if engine.rank != 0:
        return
    spec = engine.adapter_spec()
    path.mkdir(parents=True, exist_ok=True)
    engine.model.peft_config[ADAPTER_NAME].save_pretrained(str(path))
    meta = {"format": "pt", "meshrl_base_model": spec.base_model}
    save_file({n: t.contiguous() for n, t in tensors}, str(path / "adapter_model.safetensors"), metadata=meta)
    (path / "meshrl_adapter.json").write_text(json.dumps({"base_model": spec.base_model, "rank": spec.rank}))
    if full is not None:
        _save_merged(engine, full, path / "merged")


def _save_merged(engine: FSDPEngine, full: dict[str, Any], path: Path) -> None:
    """Rebuild base + adapter on the host from the gathered state, merge with peft, save."""
    from transformers import AutoModelForCausalLM

    peft = _peft()
    shell = AutoModelForCausalLM.from_config(engine.hf_config, dtype=engine.dtype,
                                             trust_remote_code=engine.spec.model.trust_remote_code)
    wrapped = peft.get_peft_model(shell, engine.model.peft_config[ADAPTER_NAME])
    wrapped.load_state_dict(full, strict=True)
    merged = wrapped.merge_and_unload()
    if engine.generation_config is not None:
        merged.generation_config = engine.generation_config
    merged.save_pretrained(path)
