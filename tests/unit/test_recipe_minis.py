"""The recipe miniatures: every one plans (same validation as the full recipes) with its tiny
model, and the FSDP ones train end to end on CPU once `meshrl train` and the FSDP engine exist
(branch `fsdp`; until that merge those tests skip and say so)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshrl.plan import RECIPES_DIR, make_plan
from tests.recipe_minis import MINI_ARCH, MINI_DIR, ROOT, tiny_model_dir


def test_every_recipe_has_a_miniature() -> None:
    assert sorted(p.stem for p in MINI_DIR.glob("*.yaml")) == sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("recipe", sorted(MINI_ARCH))
def test_miniature_plans_with_its_tiny_model(recipe: str, tmp_path: Path) -> None:
    model = tiny_model_dir(MINI_ARCH[recipe], tmp_path / "model")
    plan = make_plan(str(MINI_DIR / f"{recipe}.yaml"), [f"actor_rollout_ref.model.path={model}"])
    assert plan["model"]["source"] == "config.json"
    full = make_plan(recipe, [])
    # Same architecture family as the full recipe: MoE-ness and linear attention carry over.
    assert (plan["model"]["experts"] > 0) == (full["model"]["experts"] > 0)
    assert (plan["model"]["linear_attention_layers"] > 0) == (full["model"]["linear_attention_layers"] > 0)
    assert plan["layout"]["trainer"]["engine"] == full["layout"]["trainer"]["engine"]


def _has_train_command() -> bool:
    from meshrl.cli import build_parser

    try:
        build_parser().parse_args(["train", "--help"])
    except SystemExit as exc:
        return exc.code == 0
    return True


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["qwen3_30b_a3b_dapo_fsdp_npu", "qwen3_5_27b_grpo_fsdp"])
def test_fsdp_miniature_trains_on_cpu(recipe: str, tmp_path: Path) -> None:
    if not _has_train_command():
        pytest.skip("needs `meshrl train` (the CLI entry of the trainer loop); runs once it exists")
    model = tiny_model_dir(MINI_ARCH[recipe], tmp_path / "model")
    run = subprocess.run(
        [sys.executable, "-m", "meshrl.cli", "train", str(MINI_DIR / f"{recipe}.yaml"),
         f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
         "--run-dir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    if MINI_ARCH[recipe] == "qwen3_5":  # released layout: the export is the class the run started from
        import json

        import torch
        from safetensors.torch import load_file
        from transformers import Qwen3_5ForConditionalGeneration

        export = tmp_path / "run" / "hf_export"
        assert json.loads((export / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
        src, out = load_file(str(model / "model.safetensors")), {}
        for f in export.glob("*.safetensors"):
            out.update(load_file(str(f)))
        assert out.keys() == src.keys()
        assert all(torch.equal(out[k], src[k]) for k in src if k.startswith("model.visual."))
        assert any(not torch.equal(out[k], src[k]) for k in src if k.startswith("model.language_model."))
        Qwen3_5ForConditionalGeneration.from_pretrained(export)
