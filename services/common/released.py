"""Released multimodal checkpoints trained as their language model (Qwen3.5 as released).

Released Qwen3.5 checkpoints are `Qwen3_5ForConditionalGeneration` (model_type `qwen3_5`, or
`qwen3_5_moe`): a language model plus a vision tower, with weights `model.language_model.*`,
`model.visual.*` and `lm_head.*`. meshrl trains on text, so the trainer and the transformers
rollout load only the language model (transformers' `AutoModelForCausalLM` gives
`Qwen3_5ForCausalLM`, whose weights are named `model.*` and `lm_head.*`); the vision tower is
frozen: it is never loaded for training and is carried through from the source checkpoint.

    trainer (text names) ── to_released ──▶ published weights (released names) ──▶ rollout
    hf_export/ = source config + processor files, trained language model (released names),
                 every other tensor of the source (model.visual.*, mtp.*) byte for byte

so weights sync under the names the released class's engines expect (vLLM loads
`Qwen3_5ForConditionalGeneration` from them) and the export loads back as the class the user
started from, vision tower intact.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError

RELEASED_TYPES = frozenset({"qwen3_5", "qwen3_5_moe"})
"""Composite model types whose checkpoints nest the language model under `model.language_model`."""
TEXT_PREFIX = "model."
RELEASED_PREFIX = "model.language_model."
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


@dataclass(frozen=True)
class ReleasedLayout:
    """Name mapping between the language model as trained and the released checkpoint."""

    path: Path
    model_type: str

    def to_released(self, name: str) -> str:
        """`model.layers.0.x` -> `model.language_model.layers.0.x`; `lm_head.*` is unchanged."""
        if name.startswith(TEXT_PREFIX) and not name.startswith(RELEASED_PREFIX):
            return RELEASED_PREFIX + name[len(TEXT_PREFIX):]
        return name

    def to_text(self, name: str) -> str:
        """The inverse of `to_released` (a name outside the language model is returned as is)."""
        if name.startswith(RELEASED_PREFIX):
            return TEXT_PREFIX + name[len(RELEASED_PREFIX):]
        return name

    @staticmethod
    def is_language_model(released_name: str) -> bool:
        return released_name.startswith((RELEASED_PREFIX, "lm_head."))


def released_layout(path: str | Path | None) -> ReleasedLayout | None:
    """The layout of a released composite checkpoint at `path`; None for anything else (a plain
    causal LM, the built-in model, a path without config.json)."""
    if path is None:
        return None
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("model_type") in RELEASED_TYPES and isinstance(cfg.get("text_config"), dict):
        return ReleasedLayout(Path(path), str(cfg["model_type"]))
    return None


def check_freeze(layout: ReleasedLayout | None, freeze_vision_tower: bool) -> None:
    if layout is not None and not freeze_vision_tower:
        raise ConfigError(
            f"actor_rollout_ref.actor.freeze_vision_tower=false: {layout.model_type} is trained on text data, "
            "which gives the vision tower no gradient (multimodal training is not supported); leave it true"
        )


def _source_tensors(src: Path) -> dict[str, Any]:
    """Every tensor of the source checkpoint's safetensors files, by name (loaded lazily per file)."""
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{src} has no .safetensors files; the released-layout export needs them")
    out: dict[str, Any] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def export_released(layout: ReleasedLayout, lm_state: Mapping[str, Any], out: Path,
                    *, max_shard_size: str = "5GB") -> dict[str, int]:
    """Write a checkpoint of the released class at `out`: the source's config and processor
    files, `lm_state` (text names) under released names, every other source tensor unchanged.
    Returns {"language_model": n, "carried": m} tensor counts. Raises when `lm_state` does not
    cover exactly the source's language-model tensors (a silent partial export is worse)."""
    from huggingface_hub import save_torch_state_dict

    src = _source_tensors(layout.path)
    trained = {layout.to_released(k): v for k, v in lm_state.items()}
    expected = {k for k in src if layout.is_language_model(k)}
    # lm_head.weight of a tied model has no tensor of its own in the source: it is left out.
    if extra := (set(trained) - expected) - {"lm_head.weight"}:
        raise ValueError(f"trained tensors with no place in {layout.path}: {sorted(extra)[:5]}")
    missing = expected - set(trained)
    if missing:
        raise ValueError(f"the trained model lacks {len(missing)} language-model tensors of {layout.path}: "
                         f"{sorted(missing)[:5]}")
    carried = {k: v for k, v in src.items() if not layout.is_language_model(k)}
    state = {**carried, **{k: v.contiguous() for k, v in trained.items() if k in expected}}
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():  # a previous export's shards would be picked up with the new ones
        if stale.name.endswith(WEIGHT_SUFFIXES):
            stale.unlink()
    for f in layout.path.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, out / f.name)
    save_torch_state_dict(state, str(out), max_shard_size=max_shard_size)
    return {"language_model": len(state) - len(carried), "carried": len(carried)}
