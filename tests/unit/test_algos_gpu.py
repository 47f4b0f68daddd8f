"""The algos on a CUDA device: same numbers as on CPU, and the loss runs without device syncs
except the one metrics conversion at its end. Run on the GPU machine: pytest -m gpu tests/unit/test_algos_gpu.py"""

from __future__ import annotations

import pytest
import torch

from services.common.config.algorithm import AlgorithmConfig
from services.trainer.algos import (
    AGG_MODES,
    apply_rollout_correction,
    build_loss_fn,
    compute_advantages,
    compute_rollout_correction,
    dynamic_sampling_keep,
    loss_scale_counts,
)
from services.trainer.algos.agg import agg_loss
from services.trainer.algos.policy_loss import ppo_clip_loss
from services.trainer.engines.base import ForwardOutput, LossScale
from tests.unit.test_algos_properties import VARIANTS, configs, random_batch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_matches_cpu(mode: str, variant: str) -> None:
    batch, logp, ent = random_batch(11, 8, 12)
    actor, algo = configs(variant, mode)
    fn = build_loss_fn(actor, algo)
    tokens, seqs = loss_scale_counts(batch)
    scale = LossScale(tokens, seqs, 2)
    cpu_loss, cpu_m = fn(ForwardOutput(logp, ent), batch, scale)
    dev = batch.to("cuda")
    gpu_loss, gpu_m = fn(ForwardOutput(logp.cuda(), ent.cuda()), dev, scale)
    assert gpu_loss.item() == pytest.approx(cpu_loss.item(), rel=1e-5, abs=1e-6)
    assert gpu_m.keys() == cpu_m.keys()
    for k, v in cpu_m.items():
        assert gpu_m[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    if not algo.rollout_correction.bypass_mode:
        assert apply_rollout_correction(dev, algo).keys()


@needs_cuda
def test_advantages_and_dapo_on_cuda() -> None:
    batch, _, _ = random_batch(5, 8, 6)
    batch.seq_tensors["reward"] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.0, 1.0])
    batch.seq_tensors["group_index"] = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    for est in ("grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        cfg = AlgorithmConfig(adv_estimator=est)  # type: ignore[arg-type]
        assert torch.allclose(compute_advantages(batch.to("cuda"), cfg).cpu(), compute_advantages(batch, cfg), atol=1e-6)
    keep = dynamic_sampling_keep(batch.seq_tensors["reward"].cuda(), batch.seq_tensors["group_index"].cuda())
    assert keep.cpu().tolist() == [True, True, False, False, False, False, True, True]


@needs_cuda
def test_loss_pieces_do_not_sync() -> None:
    batch, logp, _ = random_batch(7, 8, 12)
    dev = batch.to("cuda")
    lp = logp.cuda().requires_grad_()
    _, algo = configs("decoupled_is_rs", "token-mean")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        corr = compute_rollout_correction(dev.tensors["old_logprobs"], dev.tensors["rollout_logprobs"], dev.response_mask, algo.rollout_correction)
        mat, _ = ppo_clip_loss(dev.tensors["old_logprobs"], lp, dev.tensors["advantages"], corr.keep_mask, 0.2, 0.28, 3.0, corr.weights)
        loss = agg_loss(mat, corr.keep_mask, "token-mean", LossScale(100, 8, 1))
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
