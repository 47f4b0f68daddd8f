"""Qwen3.5 as released (Qwen3_5ForConditionalGeneration: model.language_model.*, model.visual.*,
lm_head.*), tiny and built here: the FSDP engine trains its language model on text, publishes the
weights under the released names, the transformers rollout (which runs the language model) takes
them, and the export loads back as the released class with the vision tower intact."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from services.common.config.actor_rollout_ref import ActorConfig, ModelConfig
from services.common.errors import ConfigError
from services.common.released import ReleasedLayout, released_layout
from services.trainer.engines.base import EngineSpec, get_engine_cls
from services.trainer.engines.batching import micro_batches_for
from tests.recipe_minis import tiny_model_dir
from tests.unit.fsdp_helpers import fixed_batch, nll_loss

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir("qwen3_5", tmp_path_factory.mktemp("q35") / "model")


def _source(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in path.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def _spec(path: Path, *, freeze: bool = True) -> EngineSpec:
    actor = ActorConfig(optim={"lr": 1e-2}, freeze_vision_tower=freeze)
    model = ModelConfig(path=str(path), use_remove_padding=False)
    return EngineSpec(model=model, actor=actor, device="cpu", total_training_steps=10)


def test_the_miniature_is_the_released_layout(released: Path) -> None:
    cfg = json.loads((released / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    names = set(_source(released))
    assert any(n.startswith("model.visual.") for n in names) and "lm_head.weight" in names
    assert all(n.startswith(("model.language_model.", "model.visual.", "lm_head.")) for n in names)
    assert released_layout(released) == ReleasedLayout(released, "qwen3_5")


def test_train_sync_and_export_keep_the_released_class(released: Path, tmp_path: Path) -> None:
    source = _source(released)
    lm_names = {n for n in source if not n.startswith("model.visual.")}
    engine = get_engine_cls("fsdp", "cpu").build(_spec(released))
    batch = fixed_batch(num_seqs=4, length=20)
    for _ in range(2):
        engine.train_step(micro_batches_for(engine.spec.actor, batch), nll_loss)  # type: ignore[attr-defined]

    # Sync: every language-model tensor under its released name, nothing of the vision tower.
    published = {k: v for bucket in engine.export_weights(1 << 30) for k, v in bucket}
    assert set(published) == lm_names
    moved = [k for k in published if not torch.equal(published[k], source[k])]
    assert len(moved) > len(lm_names) // 2  # it trained

    # The transformers rollout runs the language model (Qwen3_5ForCausalLM) and loads them.
    from transformers import AutoModelForCausalLM

    from services.common.tiny import build_tokenizer
    from services.rollout.engines.transformers_engine import TransformersEngine

    policy = AutoModelForCausalLM.from_pretrained(released, dtype=torch.float32)
    assert type(policy).__name__ == "Qwen3_5ForCausalLM"
    layout = released_layout(released)
    assert layout is not None
    rollout = TransformersEngine(policy, build_tokenizer(), weight_name=layout.to_text)

    async def load() -> int:
        async def buckets():  # type: ignore[no-untyped-def]
            yield list(published.items())

        await rollout.start()
        try:
            await rollout.pause("keep")
            n = await rollout.load_weights(1, buckets())
            await rollout.resume()
            return n
        finally:
            await rollout.close()

    assert asyncio.run(load()) == len(lm_names)
    sd = policy.state_dict()
    assert all(torch.equal(sd[layout.to_text(k)], v) for k, v in published.items())

    # Export: loads as the released class; language model trained, vision tower byte for byte.
    out = tmp_path / "hf_export"
    engine.save_hf(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    exported = _source(out)
    assert set(exported) == set(source)
    assert all(torch.equal(exported[k], source[k]) for k in source if k.startswith("model.visual."))
    assert all(torch.equal(exported[k], published[k]) for k in lm_names)
    from transformers import Qwen3_5ForConditionalGeneration

    back = Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    back_sd = back.state_dict()
    assert all(torch.equal(back_sd[k], exported[k]) for k in exported)
    assert (out / "tokenizer.json").exists() and (out / "chat_template.jinja").exists()


def test_unfreezing_the_vision_tower_is_refused(released: Path) -> None:
    with pytest.raises(ConfigError, match=r"freeze_vision_tower=false"):
        get_engine_cls("fsdp", "cpu").build(_spec(released, freeze=False))


def test_each_ranks_own_rows_are_published_under_the_released_names(released: Path) -> None:
    """param_server.collective_sharded publishes each rank's rows (export_shards): they carried the
    text model's names (model.layers.*), not the released checkpoint's that export_weights gives
    and vLLM's Qwen3_5ForConditionalGeneration maps (model.language_model.*)."""
    from services.trainer.engines.base import get_engine_cls

    engine = get_engine_cls("fsdp", "cpu").build(_spec(released))
    whole = {k for bucket in engine.export_weights(1 << 30) for k, _ in bucket}
    shards = {k.split("@")[0] for bucket in engine.export_shards(1 << 30) for k, _ in bucket}
    assert all(n.startswith(("model.language_model.", "model.visual.", "lm_head.")) for n in whole)
    assert shards == whole, sorted(shards ^ whole)[:3]
