"""The FSDP engine on CUDA (run by scripts/gpu/trainer.sh on a GPU machine; `gpu` marker):
one device (fp32 fidelity against transformers, bf16 mixed precision learning, offload really
frees device memory and changes nothing, flash-attn varlen when installed) and two devices with
nccl (data parallel and Ulysses SP=2 against one device)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.tiny import build_tiny_model, build_tokenizer
from services.trainer.engines.base import SequenceBatch
from services.trainer.engines.batching import micro_batches_for
from tests.unit.fsdp_helpers import GRAD_PROBE_OPTIM, build, fixed_batch, full_weights, make_spec, nll_loss, run_ranks

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _train(engine: Any, batch: SequenceBatch, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(engine.train_step(micro_batches_for(engine.spec.actor, batch), nll_loss).metrics["nll_sum"])
    return out


@needs_cuda
@pytest.mark.parametrize("remove_padding", [True, False])
def test_cuda_fp32_logprobs_match_transformers(remove_padding: bool) -> None:
    tok = build_tokenizer()
    model = build_tiny_model("qwen3", tok, seed=0).cuda().eval()
    batch = fixed_batch(num_seqs=6)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda()).logits.float().cpu()
    want = torch.log_softmax(logits / 0.7, -1)[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    want = torch.cat([torch.zeros(6, 1), want], dim=1) * batch.response_mask
    engine = build(make_spec(device="cuda", remove_padding=remove_padding,
                             model_init=lambda: build_tiny_model("qwen3", tok, seed=0)))
    got = engine.compute_logprobs(batch, temperature=0.7).logprobs
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@needs_cuda
def test_cuda_bf16_mixed_precision_learns() -> None:
    engine = build(make_spec(device="cuda", mixed_precision="bf16", optim={"lr": 3e-3}, micro=2))
    losses = _train(engine, fixed_batch(), 8)
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(v.dtype == torch.float32 for b in engine.export_weights(1 << 30) for _, v in b)  # fp32 master weights


@needs_cuda
def test_cuda_offload_frees_memory_and_changes_nothing() -> None:
    import gc

    runs = []
    for on in (False, True):
        gc.collect()
        before = torch.cuda.memory_allocated()
        engine = build(make_spec(device="cuda", param_offload=on, optimizer_offload=on, with_ref=True))
        losses = _train(engine, fixed_batch(), 3)
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated() - before  # what this engine keeps on the device
        runs.append((losses, full_weights(engine), resident))
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-5)
    for k in runs[0][1]:
        torch.testing.assert_close(runs[0][1][k], runs[1][1][k], atol=1e-6, rtol=1e-5)
    assert runs[1][2] < runs[0][2], f"offload kept {runs[1][2]} bytes on the device vs {runs[0][2]}"


@needs_cuda
def test_cuda_checkpoint_round_trip(tmp_path: Path) -> None:
    a = build(make_spec(device="cuda"))
    _train(a, fixed_batch(), 2)
    a.save_checkpoint(tmp_path / "c")
    b = build(make_spec(device="cuda"))
    b.load_checkpoint(tmp_path / "c")
    wa, wb = full_weights(a), full_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and b.step == 2


@needs_cuda
def test_cuda_flash_varlen_matches_sdpa_padded() -> None:
    pytest.importorskip("flash_attn")
    batch = fixed_batch(num_seqs=6)
    packed = build(make_spec(device="cuda", mixed_precision="bf16", remove_padding=True)).compute_logprobs(batch)
    padded = build(make_spec(device="cuda", mixed_precision="bf16", remove_padding=False)).compute_logprobs(batch)
    torch.testing.assert_close(packed.logprobs, padded.logprobs, atol=3e-2, rtol=3e-2)


GPU_SCENARIOS: dict[str, dict[str, Any]] = {
    "dp2": {"device": "cuda", "optim": GRAD_PROBE_OPTIM, "grad_clip": 1e9},
    "sp2_packed": {"device": "cuda", "optim": GRAD_PROBE_OPTIM, "grad_clip": 1e9, "sp": 2},
    "sp2_padded": {"device": "cuda", "optim": GRAD_PROBE_OPTIM, "grad_clip": 1e9, "sp": 2, "remove_padding": False},
}


@needs_two
def test_two_cuda_ranks_match_one(tmp_path: Path) -> None:
    from tests.unit.fsdp_helpers import run_scenario

    ranks = run_ranks(2, GPU_SCENARIOS, tmp_path)
    engine = build(make_spec(device="cuda", optim=GRAD_PROBE_OPTIM, grad_clip=1e9))
    ref = run_scenario(engine, fixed_batch())
    for name, kw in GPU_SCENARIOS.items():
        sp = kw.get("sp", 1)
        got = torch.zeros_like(ref["logprobs"])
        for r in ranks[::sp]:
            got[torch.as_tensor(r[name]["index"])] = r[name]["logprobs"]
        torch.testing.assert_close(got, ref["logprobs"], atol=1e-4, rtol=1e-4, msg=name)
        assert ranks[0][name]["steps"][0]["grad_norm"] == pytest.approx(ref["steps"][0]["grad_norm"], rel=1e-3)
        for k, want in ref["delta"].items():
            torch.testing.assert_close(ranks[0][name]["delta"][k], want, atol=1e-6, rtol=1e-2, msg=f"{name}: {k}")
