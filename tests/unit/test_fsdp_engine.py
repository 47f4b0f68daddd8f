"""The FSDP engine on one CPU rank: learning, logprob fidelity against transformers generation,
checkpoint resume bit-for-bit, HF export, reference/proximal policies, offload, Qwen3.5 and MoE."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.errors import ConfigError
from services.common.tiny import build_tiny_model, build_tokenizer
from services.trainer.engines.base import SequenceBatch, get_engine_cls
from services.trainer.engines.batching import micro_batches_for
from services.weights.layout import fingerprint_bytes
from services.weights.packing import PackedBucket
from tests.unit.fsdp_helpers import GRAD_PROBE_OPTIM, build, fixed_batch, full_weights, make_spec, nll_loss


def _train(engine: Any, batch: SequenceBatch, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        r = engine.train_step(micro_batches_for(engine.spec.actor, batch), nll_loss)
        losses.append(r.metrics["nll_sum"])
    return losses


def test_registry_aliases_fsdp2() -> None:
    assert get_engine_cls("fsdp2", "cpu") is get_engine_cls("fsdp", "cpu")
    assert get_engine_cls("fsdp", "cuda") is get_engine_cls("fsdp", "npu") is get_engine_cls("fsdp", "cpu")


def test_loss_goes_down_on_a_fixed_batch() -> None:
    engine = build(make_spec(optim={"lr": 3e-3}, micro=2))
    losses = _train(engine, fixed_batch(), 8)
    assert losses[-1] < 0.7 * losses[0], losses
    assert engine.step == 8


def test_micro_batching_and_packing_do_not_change_the_gradient() -> None:
    deltas = []
    for kw in ({"micro": None}, {"micro": 1}, {"dynamic_bsz": True, "max_tokens": 30}, {"remove_padding": False, "micro": 3}):
        engine = build(make_spec(optim=GRAD_PROBE_OPTIM, grad_clip=1e9, **kw))  # type: ignore[arg-type]
        w0 = full_weights(engine)
        _train(engine, fixed_batch(), 1)
        w1 = full_weights(engine)
        deltas.append({k: w1[k] - w0[k] for k in w0})
    for other in deltas[1:]:
        for k in deltas[0]:
            torch.testing.assert_close(other[k], deltas[0][k], atol=2e-7, rtol=2e-3)


def test_gradient_checkpointing_gives_the_same_step() -> None:
    results = []
    for ckpt in (False, True):
        engine = build(make_spec(grad_ckpt=ckpt))
        losses = _train(engine, fixed_batch(), 2)
        results.append((losses, full_weights(engine)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for k, v in results[0][1].items():
        torch.testing.assert_close(results[1][1][k], v, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("remove_padding", [True, False])
def test_logprobs_match_transformers_generation(remove_padding: bool) -> None:
    """The rollout samples with temperature T and reports log_softmax(logits / T) of the sampled
    token; the trainer must compute the same numbers for the same weights."""
    tok = build_tokenizer()
    temperature = 0.7
    model = build_tiny_model("qwen3", tok, seed=0)
    model.eval()
    prompts = ["12+34=", "a much longer prompt here:", "x"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(1)
    gen = model.generate(
        **enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=12,
        output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
    )
    width = enc["input_ids"].shape[1]
    logits = torch.stack(gen.logits, dim=1)  # [B, new, V], raw (before the temperature warper)
    rows: list[list[int]] = []
    want: list[list[float]] = []
    prompt_lens: list[int] = []
    for i in range(len(prompts)):
        prompt = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
        response = gen.sequences[i, width:].tolist()
        if tok.eos_token_id in response:
            response = response[: response.index(tok.eos_token_id) + 1]
        lp = torch.log_softmax(logits[i, : len(response)].float() / temperature, dim=-1)
        want.append([float(lp[t, response[t]]) for t in range(len(response))])
        rows.append(prompt + response)
        prompt_lens.append(len(prompt))
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), tok.pad_token_id)
    attn = torch.zeros_like(ids)
    resp = torch.zeros(len(rows), length)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        resp[i, prompt_lens[i] : len(r)] = 1
    engine = build(make_spec(remove_padding=remove_padding, model_init=lambda: build_tiny_model("qwen3", tok, seed=0)))
    out = engine.compute_logprobs(SequenceBatch(ids, attn, resp), temperature=temperature)
    got = torch.cat([out.logprobs[i, prompt_lens[i] : len(r)] for i, r in enumerate(rows)])
    ref = torch.tensor([x for w in want for x in w])
    diff = ref - got  # log p_rollout - log p_trainer on rollout samples
    k3 = torch.exp(-diff) - 1 + diff
    assert float(k3.mean()) < 1e-5 and abs(float(diff.mean())) < 1e-5
    assert float(diff.abs().max()) < 1e-4, diff


def test_checkpoint_resume_is_bit_for_bit(tmp_path: Path) -> None:
    """Dropout on (RNG matters), a warmup + cosine schedule (scheduler state matters), AdamW."""
    kw: dict[str, Any] = {
        "override_config": {"attention_dropout": 0.2},
        "optim": {"lr": 2e-3, "lr_warmup_steps": 2, "lr_scheduler_type": "cosine", "min_lr_ratio": 0.1},
        "total_steps": 8,
        "micro": 2,
    }
    batch = fixed_batch()
    a = build(make_spec(**kw))
    _train(a, batch, 2)
    a.save_checkpoint(tmp_path / "ckpt")
    rest_a = [(a.train_step(micro_batches_for(a.spec.actor, batch), nll_loss)) for _ in range(3)]
    weights_a = full_weights(a)

    b = build(make_spec(**kw))
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.step == 2
    rest_b = [(b.train_step(micro_batches_for(b.spec.actor, batch), nll_loss)) for _ in range(3)]
    weights_b = full_weights(b)
    assert [r.metrics["nll_sum"] for r in rest_a] == [r.metrics["nll_sum"] for r in rest_b]
    assert [r.lr for r in rest_a] == [r.lr for r in rest_b]
    assert [r.grad_norm for r in rest_a] == [r.grad_norm for r in rest_b]
    for k in weights_a:
        assert torch.equal(weights_a[k], weights_b[k]), k
    # without restoring the RNG the dropout masks differ: the check above is not vacuous
    c = build(make_spec(**kw))
    c.load_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(123)
    assert c.train_step(micro_batches_for(c.spec.actor, batch), nll_loss).metrics["nll_sum"] != rest_a[0].metrics["nll_sum"]


def test_hf_export_loads_with_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = build(make_spec())
    batch = fixed_batch()
    _train(engine, batch, 2)
    engine.save_hf(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    exported = full_weights(engine)
    state = model.state_dict()
    for name, tensor in exported.items():
        assert torch.equal(state[name], tensor), name
    ours = engine.compute_logprobs(batch).logprobs
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    theirs = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(ours[:, 1:], theirs * batch.response_mask[:, 1:], atol=1e-5, rtol=1e-5)


def test_export_weights_buckets_by_size_with_hf_names() -> None:
    engine = build(make_spec())
    bucket_bytes = 64 * 1024
    buckets = list(engine.export_weights(bucket_bytes))
    assert len(buckets) > 1
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= bucket_bytes or len(bucket) == 1
        storages = {t.untyped_storage().data_ptr() for _, t in bucket}
        assert len(storages) == 1 and bucket[0][1].untyped_storage().nbytes() == size  # packed: one host buffer
        assert all(t.device.type == "cpu" for _, t in bucket)
        assert isinstance(bucket, PackedBucket) and bucket.fingerprint == fingerprint_bytes(bucket.buffer.numpy())
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(t, params[n].detach()) and t.data_ptr() != params[n].data_ptr()
               for b in buckets for n, t in b if n in params)  # copies of the weights, not the weights
    names = [n for b in buckets for n, _ in b]
    hf_names = set(build_tiny_model("qwen3", build_tokenizer(), hidden_size=64, num_hidden_layers=2, head_dim=16,
                                    intermediate_size=128).state_dict())
    assert len(names) == len(set(names))
    assert set(names) <= hf_names and hf_names - set(names) <= {"lm_head.weight"}  # tied to embed_tokens


def test_reference_stays_initial_and_proximal_snapshot_is_exact() -> None:
    engine = build(make_spec(with_ref=True, optim={"lr": 1e-2}))
    batch = fixed_batch()
    initial = engine.compute_logprobs(batch).logprobs
    engine.snapshot_proximal()
    _train(engine, batch, 2)
    after = engine.compute_logprobs(batch).logprobs
    assert not torch.allclose(after, initial)
    assert torch.equal(engine.compute_logprobs(batch, reference=True).logprobs, initial)
    assert torch.equal(engine.compute_proximal_logprobs(batch).logprobs, initial)
    assert torch.equal(engine.compute_logprobs(batch).logprobs, after)  # the swap put the weights back


def test_offload_on_and_off_agree() -> None:
    runs = []
    for on in (False, True):
        engine = build(make_spec(param_offload=on, optimizer_offload=on, with_ref=True))
        losses = _train(engine, fixed_batch(), 3)
        ref = engine.compute_logprobs(fixed_batch(), reference=True).logprobs
        runs.append((losses, full_weights(engine), ref))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][2], runs[1][2])
    for k in runs[0][1]:
        assert torch.equal(runs[0][1][k], runs[1][1][k])


def _tiny_qwen35() -> Any:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    tok = build_tokenizer()
    cfg = Qwen3_5TextConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"], pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def test_qwen35_rejects_packed_batches_and_trains_unpacked() -> None:
    with pytest.raises(ConfigError, match=r"use_remove_padding=false"):
        build(make_spec(remove_padding=True, model_init=_tiny_qwen35))
    with pytest.raises(ConfigError, match=r"ulysses_sequence_parallel_size=1"):
        build(make_spec(remove_padding=False, sp=2, model_init=_tiny_qwen35))
    engine = build(make_spec(remove_padding=False, model_init=_tiny_qwen35, optim={"lr": 1e-2}))
    losses = _train(engine, fixed_batch(), 3)
    assert engine.step == 3 and losses[-1] < losses[0]


def test_qwen3_moe_trains_packed() -> None:
    tok = build_tokenizer()
    engine = build(make_spec(model_init=lambda: build_tiny_model("qwen3_moe", tok, seed=0), optim={"lr": 1e-2}))
    losses = _train(engine, fixed_batch(), 3)
    assert losses[-1] < losses[0]


def test_unknown_override_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"override_config\.attn_dropout"):
        build(make_spec(override_config={"attn_dropout": 0.1}))


def test_ppo_max_token_len_too_small_is_named() -> None:
    engine = build(make_spec(dynamic_bsz=True, max_tokens=8))
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        engine.compute_logprobs(fixed_batch())
