"""Adapter versions the rollout (in place) and the PEFT directory apply exactly as the trainer
computes them, or refuse: regex target_modules, a changed layer config, an adapter for a base the
full weights replaced."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.errors import FailedPrecondition
from services.common.tiny import build_tokenizer, save_pretrained_pair
from services.rollout.engines.adapters import InPlaceLoRA
from services.weights.adapter import (
    base_identity_for,
    base_identity_of_module,
    saved_name,
    split_descriptor,
    write_peft_dir,
)
from tests.unit.fsdp_helpers import build, make_spec, tiny_init

pytestmark = pytest.mark.unit

IDS = torch.randint(6, 90, (2, 12), generator=torch.Generator().manual_seed(0))


def _peft(base: Any, seed: int = 1, **kw: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    cfg = {"r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM", "target_modules": "all-linear", **kw}
    model = get_peft_model(copy.deepcopy(base), LoraConfig(**cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    return [(saved_name(n), p.detach().clone()) for n, p in model.named_parameters() if ".lora_" in n]


def test_an_adapter_path_with_regex_targets_reaches_the_rollout_and_the_peft_dir(tmp_path: Path) -> None:
    """lora_adapter_path whose adapter_config.json has a regex `target_modules` (peft: fullmatch on
    the module path): the trainer trains it, so the rollout and the PEFT directory vLLM loads must
    target the same modules, not a module literally named like the regex."""
    from peft import PeftModel

    base = tiny_init().eval()
    _peft(base, target_modules=r".*\.(q_proj|v_proj)").save_pretrained(tmp_path / "start")
    engine: Any = build(make_spec(remove_padding=False, model_extra={"lora_rank": 8, "lora_alpha": 16,
                                               "lora_adapter_path": str(tmp_path / "start")}))
    buckets = list(engine.export_weights(1 << 30))
    spec, first = split_descriptor(buckets[0])
    assert spec is not None
    tensors = list(first) + [t for b in buckets[1:] for t in b]
    with torch.no_grad():
        want = engine.model(input_ids=IDS).logits
    rollout = InPlaceLoRA(copy.deepcopy(base))
    rollout.load(spec, tensors, first=True, last=True)
    with torch.no_grad():
        torch.testing.assert_close(rollout.model(input_ids=IDS).logits, want, atol=1e-5, rtol=1e-5)
    out = write_peft_dir(spec, tensors, tmp_path / "for-vllm")
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == r".*\.(q_proj|v_proj)"
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change", [{"use_rslora": True}, {"alpha_pattern": {"v_proj": 64}},
                                    {"layers_to_transform": 0}])  # layer 0 only (0 == False)
def test_a_version_whose_layer_config_changed_is_refused(change: dict[str, Any]) -> None:
    """The injected layers fix the scaling (use_rslora, alpha_pattern, ...): a later version with
    the same rank, alpha and targets but another such field would be copied into layers that scale
    it otherwise (silently another function than the trainer's)."""
    from services.trainer.engines.fsdp_lora import spec_of

    base = tiny_init().eval()
    bid = base_identity_of_module(base, "builtin")
    # peft takes layers_to_transform only with a list of target modules
    common = {"target_modules": ["q_proj", "v_proj"]} if "layers_to_transform" in change else {}
    a, b = _peft(base, seed=1, **common), _peft(base, seed=2, **common, **change)
    rollout = InPlaceLoRA(copy.deepcopy(base))
    rollout.load(spec_of(a, bid, None), _tensors(a), first=True, last=True)
    before = {k: v.clone() for k, v in rollout._params.items()}
    with pytest.raises(FailedPrecondition):
        rollout.load(spec_of(b, bid, None), _tensors(b), first=True, last=True)
    assert all(torch.equal(before[k], rollout._params[k]) for k in before)  # refused before any copy


def test_after_full_weights_an_adapter_for_the_checkpoint_base_is_refused(tmp_path: Path) -> None:
    """A model loaded from a checkpoint directory whose weights a full version then replaced: the
    adapter trained on the directory's weights no longer applies (the vLLM engine refuses it; the
    docstring of InPlaceLoRA.base_replaced says the identity is taken again)."""
    from transformers import AutoModelForCausalLM

    from services.trainer.engines.fsdp_lora import spec_of

    save_pretrained_pair(tiny_init(), build_tokenizer(), tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    rollout = InPlaceLoRA(model)
    bid = base_identity_for(model, str(tmp_path / "ckpt"))
    adapter = _peft(tiny_init(), seed=1)
    spec = spec_of(adapter, bid, str(tmp_path / "ckpt"))
    rollout.load(spec, _tensors(adapter), first=True, last=True)
    # a full-weight version (as TransformersScheduler._load_bucket): accepted, then copied
    rollout.base_replaced()
    rollout.load(spec, _tensors(adapter), first=True, last=True)  # the same weights again: still its base
    rollout.base_replaced()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" not in name:
                p.add_(0.05)
    with pytest.raises(FailedPrecondition, match="for base model"):
        rollout.load(spec, _tensors(adapter), first=True, last=True)


def test_a_refused_first_adapter_leaves_the_model_without_lora_layers() -> None:
    """The first adapter's layers are injected to check its bucket against them: a bucket refused
    there takes them out again, so the model is as it was and an adapter of another shape (the
    corrected one) still loads, exactly as peft computes it."""
    from services.common.errors import InvalidArgument
    from services.trainer.engines.fsdp_lora import spec_of

    base = tiny_init().eval()
    bid = base_identity_of_module(base, "builtin")
    wrong, right = _peft(base, seed=1), _peft(base, seed=2, r=4, lora_alpha=8)
    rollout = InPlaceLoRA(copy.deepcopy(base))
    modules_before = [type(m).__name__ for m in rollout.model.modules()]
    bad = [(name.replace("self_attn", "cross_attn"), t) for name, t in _tensors(wrong)]  # no such layers
    with pytest.raises(InvalidArgument, match="no LoRA layer"):
        rollout.load(spec_of(wrong, bid, None), bad, first=True, last=True)
    assert [type(m).__name__ for m in rollout.model.modules()] == modules_before
    assert not any(".lora_" in n for n, _ in rollout.model.named_parameters()) and rollout.spec is None
    rollout.load(spec_of(right, bid, None), _tensors(right), first=True, last=True)
    with torch.no_grad():
        torch.testing.assert_close(rollout.model(input_ids=IDS).logits, right(input_ids=IDS).logits,
                                   atol=1e-5, rtol=1e-5)
