"""LoRA in the fsdp engine (actor_rollout_ref.model.lora_rank > 0): only the adapter trains, the
reference is the base with the adapter disabled, versions and checkpoints hold the adapter alone,
the HF export is a PEFT adapter (and optionally the merged model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.config import MeshConfig
from services.common.config.actor_rollout_ref import ModelConfig
from services.common.errors import ConfigError
from services.trainer.engines.base import SequenceBatch
from services.trainer.engines.batching import micro_batches_for
from services.weights.adapter import DESCRIPTOR_NAME, AdapterSpec, base_identity_of_module, split_descriptor
from tests.unit.fsdp_helpers import build, fixed_batch, full_weights, make_spec, nll_loss, tiny_init

pytestmark = pytest.mark.unit

LORA: dict[str, Any] = {"lora_rank": 8, "lora_alpha": 16}


def _train(engine: Any, batch: SequenceBatch, steps: int) -> list[Any]:
    return [engine.train_step(micro_batches_for(engine.spec.actor, batch), nll_loss) for _ in range(steps)]


def _version(engine: Any) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    buckets = [b for b in engine.export_weights(1 << 30)]
    spec, first = split_descriptor(buckets[0])
    assert spec is not None
    tensors = dict(first)
    for b in buckets[1:]:
        tensors.update(b)
    return spec, tensors


def test_config_names_the_fix() -> None:
    with pytest.raises(ValueError, match="lora_rank"):
        ModelConfig(lora_adapter_path="/some/adapter")
    with pytest.raises(ValueError, match="all-linear or a list"):
        ModelConfig(lora_rank=8, target_modules="q_proj")
    with pytest.raises(ValueError, match="empty list"):
        ModelConfig(lora_rank=8, target_modules=[])
    for strategy in ("megatron", "mindspeed"):
        with pytest.raises(ValueError, match=f"LoRA is not supported by the {strategy} engine"):
            MeshConfig.model_validate({"actor_rollout_ref": {"model": {"lora_rank": 8}, "actor": {"strategy": strategy}}})
    ok = MeshConfig.model_validate(
        {"actor_rollout_ref": {"model": {"lora_rank": 32, "target_modules": ["q_proj", "v_proj"], "exclude_modules": ["k_proj"]}}}
    )
    assert ok.actor_rollout_ref.model.lora_rank == 32


def test_only_the_adapter_trains_and_versions_hold_it_alone() -> None:
    engine: Any = build(make_spec(model_extra=LORA))
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    base_before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    spec0, v0 = _version(engine)
    batch = fixed_batch()
    losses = [r.metrics["nll_sum"] for r in _train(engine, batch, 4)]
    assert losses[-1] < losses[0]
    for n, p in engine.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), f"frozen base weight {n} changed"
    spec1, v1 = _version(engine)
    assert spec0 == spec1 and spec1.rank == 8 and spec1.alpha == 16.0
    kinds = {m.rsplit(".", 1)[-1] for m in spec1.target_modules}  # peft keeps full paths for few modules
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert spec1.base_model == base_identity_of_module(tiny_init(), "builtin")
    assert set(v1) == set(v0) and all(k.startswith("base_model.model.") and ".lora_" in k for k in v1)
    assert any(not torch.equal(v0[k], v1[k]) for k in v1 if ".lora_B." in k)  # B starts at 0 and moves
    full_bytes = sum(p.numel() * p.element_size() for p in tiny_init().parameters())
    assert sum(t.numel() * t.element_size() for t in v1.values()) < full_bytes


def test_reference_is_the_base_with_the_adapter_disabled() -> None:
    batch = fixed_batch()
    engine: Any = build(make_spec(model_extra=LORA, with_ref=True))
    assert engine.ref_model is None  # no second copy of the model
    start = engine.compute_logprobs(batch).logprobs
    torch.testing.assert_close(engine.compute_logprobs(batch, reference=True).logprobs, start)  # B = 0 at start
    _train(engine, batch, 3)
    after = engine.compute_logprobs(batch).logprobs
    ref = engine.compute_logprobs(batch, reference=True).logprobs
    assert not torch.allclose(after, start)
    plain = build(make_spec())
    torch.testing.assert_close(ref, plain.compute_logprobs(batch).logprobs, atol=1e-6, rtol=1e-6)


def test_checkpoint_holds_the_adapter_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"model_extra": LORA, "optim": {"lr": 2e-3, "lr_warmup_steps": 2}, "total_steps": 8}
    batch = fixed_batch()
    a: Any = build(make_spec(**kw))
    _train(a, batch, 2)
    a.save_checkpoint(tmp_path / "ckpt")
    rest_a = [r.metrics["nll_sum"] for r in _train(a, batch, 2)]
    b: Any = build(make_spec(**kw))
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.step == 2
    rest_b = [r.metrics["nll_sum"] for r in _train(b, batch, 2)]
    assert rest_a == rest_b
    wa, wb = full_weights(a), full_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa if k != DESCRIPTOR_NAME)
    state = dcp_keys(tmp_path / "ckpt" / "dcp")
    model_keys = [k for k in state if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), "a LoRA checkpoint must not hold the frozen base"


def dcp_keys(path: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def test_hf_export_is_a_peft_adapter_and_a_merged_model(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = fixed_batch()
    engine: Any = build(make_spec(model_extra={**LORA, "lora_export_merged": True}))
    _train(engine, batch, 3)
    ours = engine.compute_logprobs(batch).logprobs
    engine.save_hf(tmp_path / "hf")
    assert (tmp_path / "hf" / "adapter_config.json").exists()

    def logprobs(model: Any) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        return lp * batch.response_mask[:, 1:]

    adapted = PeftModel.from_pretrained(tiny_init(), tmp_path / "hf").eval()
    torch.testing.assert_close(logprobs(adapted), ours[:, 1:], atol=1e-5, rtol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "merged").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logprobs(merged), ours[:, 1:], atol=1e-5, rtol=1e-5)

    # lora_adapter_path: a run starts from that adapter
    again: Any = build(make_spec(model_extra={**LORA, "lora_adapter_path": str(tmp_path / "hf")}))
    torch.testing.assert_close(again.compute_logprobs(batch).logprobs, ours, atol=1e-6, rtol=1e-6)
    assert _train(again, batch, 1)[0].metrics["nll_sum"] > 0
    with pytest.raises(ConfigError, match="set lora_rank=8"):
        build(make_spec(model_extra={"lora_rank": 4, "lora_adapter_path": str(tmp_path / "hf")}))


def test_a_checkpoints_huggingface_copy_of_a_lora_policy_is_the_adapter(tmp_path: Path) -> None:
    """save_contents with hf_model wrote a LoRA engine's PEFT-wrapped state (base_model.model.*
    names) through a plain HF shell: from_pretrained matched none of it and loaded a random
    model. It is the adapter directory, as the final export writes."""
    from peft import PeftModel

    from services.common.config.actor_rollout_ref import CheckpointContentsConfig

    spec = make_spec(model_extra=LORA, optim={"lr": 1e-2})
    spec.actor.checkpoint = CheckpointContentsConfig(save_contents=["model", "optimizer", "extra", "hf_model"])
    engine: Any = build(spec)
    batch = fixed_batch()
    _train(engine, batch, 3)
    ours = engine.compute_logprobs(batch).logprobs
    engine.save_checkpoint(tmp_path / "ckpt")
    adapted = PeftModel.from_pretrained(tiny_init(), tmp_path / "ckpt" / "huggingface").eval()
    with torch.no_grad():
        logits = adapted(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp * batch.response_mask[:, 1:], ours[:, 1:], atol=1e-5, rtol=1e-5)


def test_target_and_exclude_modules() -> None:
    engine: Any = build(make_spec(model_extra={**LORA, "target_modules": ["q_proj", "v_proj"], "exclude_modules": ["k_proj"]}))
    spec, tensors = _version(engine)
    assert {m.rsplit(".", 1)[-1] for m in spec.target_modules} == {"q_proj", "v_proj"}
    assert {k.split(".")[-3] for k in tensors} == {"q_proj", "v_proj"}


def test_two_sharded_ranks_train_the_adapter_as_one_rank(tmp_path: Path) -> None:
    """FSDP2 shards frozen base and trainable adapter in the same units; two gloo ranks give one
    rank's logprobs, grad norm and adapter update (GRAD_PROBE_OPTIM: the update is linear in the
    gradient), and rank 0 alone exports the adapter version."""
    from tests.unit.fsdp_helpers import GRAD_PROBE_OPTIM, run_ranks, run_scenario

    kw: dict[str, Any] = {"optim": GRAD_PROBE_OPTIM, "grad_clip": 1e9, "model_extra": LORA}
    trained: Any = build(make_spec(model_extra=LORA, optim={"lr": 1e-2}))
    _train(trained, fixed_batch(), 2)
    trained.save_hf(tmp_path / "adapter")
    from_adapter = {"model_extra": {**LORA, "lora_adapter_path": str(tmp_path / "adapter")}}
    ranks = run_ranks(2, {"lora": kw, "from_adapter": from_adapter}, tmp_path)
    # lora_adapter_path on ranks that build on the meta device: rank 0's adapter reaches them
    want_lp = trained.compute_logprobs(fixed_batch()).logprobs
    got_lp = torch.zeros_like(want_lp)
    for r in ranks:
        part = r["from_adapter"]
        got_lp[torch.as_tensor(part["index"]), : part["logprobs"].shape[1]] = part["logprobs"]
    torch.testing.assert_close(got_lp, want_lp, atol=2e-5, rtol=1e-4)
    ref = run_scenario(build(make_spec(**kw)), fixed_batch())
    got = torch.zeros_like(ref["logprobs"])
    for r in ranks:
        part = r["lora"]
        got[torch.as_tensor(part["index"]), : part["logprobs"].shape[1]] = part["logprobs"]
        assert part["steps"][0]["grad_norm"] == pytest.approx(ref["steps"][0]["grad_norm"], rel=1e-4)
    torch.testing.assert_close(got, ref["logprobs"], atol=2e-5, rtol=1e-4)
    delta, want = ranks[0]["lora"]["delta"], ref["delta"]
    assert delta.keys() == want.keys() and DESCRIPTOR_NAME in want and ranks[1]["lora"]["delta"] == {}
    for k in want:
        torch.testing.assert_close(delta[k].float(), want[k].float(), atol=2e-7, rtol=2e-3, msg=k)
    assert any(float(want[k].float().abs().max()) > 1e-6 for k in want if ".lora_B." in k)


def test_proximal_snapshot_holds_the_adapter() -> None:
    """Decoupled PPO's proximal policy with LoRA: the snapshot is the adapter's parameters (the
    base never changes), and its logprobs are the policy's at the snapshot."""
    batch = fixed_batch()
    engine: Any = build(make_spec(model_extra=LORA, optim={"lr": 1e-2}))
    _train(engine, batch, 1)
    engine.snapshot_proximal()
    assert len(engine._proximal) == sum(1 for p in engine.model.parameters() if p.requires_grad)
    at_snapshot = engine.compute_logprobs(batch).logprobs
    _train(engine, batch, 2)
    assert not torch.allclose(engine.compute_logprobs(batch).logprobs, at_snapshot)
    torch.testing.assert_close(engine.compute_proximal_logprobs(batch).logprobs, at_snapshot, atol=0, rtol=0)
