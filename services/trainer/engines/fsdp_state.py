"""Checkpoint and Hugging Face export for the FSDP engine.

Layout of a checkpoint directory (every rank writes its shard; rank 0 writes the metadata):

    <path>/dcp/            torch.distributed.checkpoint: model (+ optimizer) shards, reshardable
    <path>/extra_rank{r}.pt  scheduler, step, RNG states of rank r (python, torch, device)
    <path>/huggingface/    only with checkpoint.save_contents containing "hf_model"

With LoRA (fsdp_lora.py) model and optimizer state are the adapter's alone.

Resuming with the same world size restores every RNG stream, so a run continues bit-for-bit on
CPU; with another world size model and optimizer reshard and RNG is reseeded (logged).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from services.common.errors import NotFound
from services.common.logging import get_logger
from services.common.released import export_released

if TYPE_CHECKING:
    from .fsdp import FSDPEngine

log = get_logger(__name__)


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type in ("cuda", "npu"):
        state["device"] = getattr(torch, device.type).get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "device" in state and device.type in ("cuda", "npu"):
        getattr(torch, device.type).set_rng_state(state["device"], device)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _options(engine: FSDPEngine) -> StateDictOptions:
    """With LoRA a checkpoint holds the adapter (and its optimizer state) only: the frozen base
    comes from actor_rollout_ref.model.path on resume, so it is neither saved nor expected."""
    return StateDictOptions(ignore_frozen_params=True, strict=False) if engine.lora else StateDictOptions()


def _trained_only(engine: FSDPEngine, model_sd: dict[str, Any]) -> dict[str, Any]:
    """With LoRA, the adapter's entries only: `ignore_frozen_params` filters parameters, but a
    tied alias of a frozen weight (lm_head.weight of tied embeddings) is not a parameter name and
    would still be saved."""
    if not engine.lora:
        return model_sd
    trained = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in trained}


def save_state(engine: FSDPEngine, path: Path) -> None:
    contents = set(engine.spec.actor.checkpoint.save_contents)
    path.mkdir(parents=True, exist_ok=True)
    if "model" in contents or "optimizer" in contents:
        opts = _options(engine)
        if "optimizer" in contents:
            model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=opts)
            state: dict[str, Any] = {"model": _trained_only(engine, model_sd), "optim": optim_sd}
        else:
            state = {"model": _trained_only(engine, get_model_state_dict(engine.model, options=opts))}
        dcp.save(state, checkpoint_id=str(path / "dcp"))
    if "extra" in contents:
        extra = {
            "scheduler": engine.scheduler.state_dict(),
            "step": engine.step,
            "rng": _rng_state(engine.device),
            "world_size": engine.world_size,
        }
        torch.save(extra, path / f"extra_rank{engine.rank}.pt")
    if "hf_model" in contents:
        if engine.lora:  # a PEFT adapter directory (as save_hf writes): the plain HF shell loads none of the wrapped names
            from . import fsdp_lora

            fsdp_lora.save_adapter(engine, path / "huggingface", merged=engine.spec.model.lora_export_merged)
        else:
            save_hf_weights(engine, path / "huggingface")
    _barrier()


def load_state(engine: FSDPEngine, path: Path) -> None:
    contents = set(engine.spec.actor.checkpoint.load_contents or ())  # resolved from save_contents when null
    if not (path / "dcp").exists():
        raise NotFound(f"{path} is not a trainer checkpoint (no dcp/ directory)")
    opts = _options(engine)
    if "optimizer" in contents:
        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=opts)
        state: dict[str, Any] = {"model": _trained_only(engine, model_sd), "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(engine.model, engine.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=opts)
    elif "model" in contents:
        state = {"model": _trained_only(engine, get_model_state_dict(engine.model, options=opts))}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_model_state_dict(engine.model, state["model"], options=opts)
    if "extra" in contents:
        mine = path / f"extra_rank{engine.rank}.pt"
        same_world = mine.exists()
        extra = torch.load(mine if same_world else path / "extra_rank0.pt", weights_only=False)
        same_world = same_world and extra.get("world_size") == engine.world_size
        engine.scheduler.load_state_dict(extra["scheduler"])
        # the schedule's position sets the lr: the optimizer's groups hold it only when its state
        # was loaded too (load_contents without `optimizer`: they would keep step 0's)
        for group, lr in zip(engine.optimizer.param_groups, engine.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
        engine._step = int(extra["step"])
        if same_world:
            _set_rng_state(extra["rng"], engine.device)
        else:
            seed = engine.spec.seed + engine.rank + engine._step
            torch.manual_seed(seed)
            random.seed(seed)
            log.warning("checkpoint_world_size_changed", path=str(path), rng="reseeded", seed=seed)
    _barrier()


def save_hf_weights(engine: FSDPEngine, path: Path) -> None:
    """Gather full weights to rank 0 and write them with save_pretrained (safetensors)."""
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if engine.rank == 0 and engine.released is not None:
        # The class the user started from: its config, processor and vision tower, the trained
        # language model under its released names.
        counts = export_released(engine.released, full, path)
        log.info("hf_export_released", path=str(path), model_type=engine.released.model_type, **counts)
    elif engine.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(engine.hf_config, dtype=engine.dtype,
                                                     trust_remote_code=engine.spec.model.trust_remote_code)
        if engine.generation_config is not None:
            shell.generation_config = engine.generation_config
        shell.save_pretrained(path, state_dict=full)
    _barrier()
