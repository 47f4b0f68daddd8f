"""The megatron engine on CPU (gloo, torchrun subprocesses) against plain transformers forward /
backward / AdamW on the same HF weights: logprobs, entropy, three optimizer steps with gradient
accumulation and clipping, bit-exact HF round trip, export, checkpoint resume.

Tolerances (tests/megatron_cases.py): logprobs/entropy 1e-4 abs, grad norm 1e-4 rel, logprobs
after 3 AdamW steps (lr 1e-3) 1e-3 abs; resume and HF round trip exact."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests.megatron_cases import RESUME_ATOL, check_equivalence, run_worker, tiny_checkpoint

N_MICRO = 4  # 8 sequences in micro-batches of 2, over all DP ranks (metrics are averaged over them)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("megatron_ckpt")
    out = {arch: tiny_checkpoint(arch, base / arch) for arch in ("qwen3", "qwen3_moe")}
    # megatron 0.16 moves tied output weights with .cuda() when PP > 1: untied for the CPU PP test.
    out["qwen3_untied"] = tiny_checkpoint("qwen3", base / "qwen3_untied", tie_word_embeddings=False)
    return out


def test_dense_tp2_built_from_spec_matches_transformers_and_resumes(ckpts: dict[str, Path], tmp_path: Path) -> None:
    r = run_worker(ckpts["qwen3"], tmp_path / "r.json", 2, "--tp", "2", "--sp", "--save-dir", str(tmp_path / "save"),
                   "--build-spec", "--proximal")
    check_equivalence(r, n_micro=N_MICRO)
    # Built through TrainEngine.build(spec) from a model_init callable (model.path=null).
    assert r["dp"] == [0, 1]
    # Decoupled PPO: the proximal snapshot reproduces the pre-training logprobs exactly, and the
    # current parameters come back afterwards.
    assert r["proximal_logprob_max_abs_diff"] == 0.0 and r["restored_after_proximal"]
    assert "resume_error" not in r, r.get("resume_error")
    assert r["resume_loss_diff"] <= RESUME_ATOL and r["resume_grad_norm_diff"] <= RESUME_ATOL
    assert r["save_hf_exact"]


def test_dense_pp2_uneven_stages_matches_transformers_and_resumes(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """megatron's real 1F1B pipeline schedule over gloo: 1 layer on stage 0, 3 on stage 1;
    export gathers across stages; save_hf and resume are exact."""
    r = run_worker(ckpts["qwen3_untied"], tmp_path / "r.json", 2, "--pp", "2", "--first-stage-layers", "1",
                   "--last-stage-layers", "3", "--save-dir", str(tmp_path / "save"))
    check_equivalence(r, n_micro=N_MICRO)
    assert "resume_error" not in r, r.get("resume_error")
    assert r["resume_loss_diff"] <= RESUME_ATOL and r["save_hf_exact"]


def test_dense_pp2_vpp2_ragged_micro_batches_match_transformers(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """The interleaved (VPP) schedule over gloo with PP=2 (previous = next stage): 3 micro-batches
    of different lengths and sizes, which the engine splits to 4 (megatron wants a multiple of
    PP) and pads to one shape. Before the p2p fixes the gradients were ~2000x off (batched p2p
    paired activations with gradients) and ragged shapes failed gloo's size check."""
    r = run_worker(ckpts["qwen3_untied"], tmp_path / "r.json", 2, "--pp", "2", "--vpp", "2", "--micro", "3", "--ragged")
    check_equivalence(r, n_micro=4)  # the metrics' mean is over the 4 micro-batches run


def test_a_dp_rank_with_no_sequences_keeps_in_step(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """A batch with fewer sequences than DP ranks leaves a rank an empty share: it runs a dummy
    (training: in the gradient all-reduce) and the step is the one rank 0's sequences give alone.
    A step with no response token on any rank is skipped by all of them together.
    (MoE on CPU uses the allgather dispatcher, which needs equal token counts on every rank; the
    GPU's alltoall does not, so the MoE case is not run here.)"""
    r = run_worker(ckpts["qwen3"], tmp_path / "r.json", 2, "--uneven-dp", "--all-rejected", "--nonfinite")
    check_equivalence(r, n_micro=N_MICRO)
    assert r["dp"] == [0, 2]
    full, empty = r["share_logprob_shapes"]
    assert full[0][0] == 8 and empty == [[0, full[0][1]], [0, full[1][1]]], r["share_logprob_shapes"]
    # Then a step whose every response token is masked out (the rollout correction rejected them
    # all): skipped on every rank, weights kept. Its loss divided by zero tokens and raised.
    assert r["all_rejected"] == {"step": 4, "num_tokens_are_the_batchs": True, "step_skipped": 1.0, "weights_kept": True}, r["all_rejected"]
    # Then a step whose gradient norm is NaN (a bf16 overflow): skipped as the FSDP engine skips
    # it, with the same metrics, the schedule's step counted, and the next step clean. megatron's
    # optimizer skips only on an fp16 loss-scale overflow; otherwise it stepped every weight to NaN.
    # actor/step_skipped is reported on every step, so its mean over a step's mini-batches is the
    # fraction skipped.
    assert r["nonfinite"] == {
        "normal_step_skipped": 0.0, "normal_grad_norm_nonfinite": 0.0, "step": 5, "grad_norm_finite": False,
        "step_skipped": 1.0, "grad_norm_nonfinite": 1.0, "weights_kept": True, "next_step_skipped": 0.0,
        "next_grad_norm_finite": True,
    }, r["nonfinite"]


def test_moe_tp2_ep2_matches_transformers(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """2 ranks: attention/dense TP=2 with sequence parallelism, experts EP=2 x ETP=1."""
    r = run_worker(ckpts["qwen3_moe"], tmp_path / "r.json", 2, "--tp", "2", "--ep", "2", "--etp", "1", "--sp")
    check_equivalence(r, n_micro=N_MICRO)


@pytest.mark.slow
def test_moe_ep2_dp2_matches_transformers(ckpts: dict[str, Path], tmp_path: Path) -> None:
    r = run_worker(ckpts["qwen3_moe"], tmp_path / "r.json", 2, "--ep", "2", "--micro", "2")
    assert r["layout"]["dp"] == 2
    check_equivalence(r, n_micro=N_MICRO)  # metrics average over all micro-batches of all DP ranks


@pytest.mark.slow
def test_moe_tp2_ep2_etp2_four_ranks(ckpts: dict[str, Path], tmp_path: Path) -> None:
    r = run_worker(ckpts["qwen3_moe"], tmp_path / "r.json", 4, "--tp", "2", "--ep", "2", "--sp", "--steps", "2")
    check_equivalence(r, n_micro=N_MICRO)


def test_overrides_reach_the_model_and_the_optimizer(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """override_transformer_config / override_optimizer_config are really applied (verl once
    shipped a release where they were silently dropped): a changed norm epsilon shows up in the
    model's config and in its logprobs; lr=0 through the optimizer override freezes the weights."""
    r = run_worker(
        ckpts["qwen3"], tmp_path / "r.json", 1, "--steps", "1",
        "--override-transformer", '{"layernorm_epsilon": 0.5}', "--override-optimizer", '{"lr": 0.0}',
    )
    assert r["applied_transformer"] == {"layernorm_epsilon": "0.5"}
    assert r["applied_optimizer"] == {"lr": "0.0"}
    assert r["logprob_max_abs_diff"] > 1e-2  # the HF reference keeps rms_norm_eps=1e-6
    assert r["export_equals_initial"] is True and r["lrs"] == [0.0]


class _Bf16MegatronOptimizer:
    """megatron-core 0.16's optimizer as the engine drives it on GPU (FP32Optimizer /
    Float16OptimizerWithFloat16Params without a grad scaler): `prepare_grads` finds nothing to
    skip, so `step()` clips by the NaN norm (a no-op) and steps every weight to NaN. CUDA-only in
    megatron, hence this stand-in with megatron's step logic."""

    def __init__(self, grad_norm: float, clip_grad: float = 1.0) -> None:
        from types import SimpleNamespace

        self.grad_norm, self.stepped = grad_norm, False
        self.param_groups = [{"lr": 0.0}]
        self.config = SimpleNamespace(clip_grad=clip_grad, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)

    def prepare_grads(self) -> bool:
        return False

    def get_grad_norm(self) -> float:
        return self.grad_norm

    def get_parameters(self) -> list:
        return []

    def step_with_ready_grads(self) -> bool:
        self.stepped = True
        return True

    def step(self) -> tuple[bool, float | None, None]:
        self.prepare_grads()
        norm = self.get_grad_norm() if self.config.clip_grad > 0 else None  # FP32Optimizer: no norm without clipping
        return self.step_with_ready_grads(), norm, None


def test_a_non_finite_grad_norm_skips_megatrons_optimizer_step() -> None:
    """On GPU the engine runs megatron's optimizer, which skips only on an fp16 loss-scale
    overflow: a NaN gradient norm in bf16 stepped every weight to NaN. The engine skips the step
    as the FSDP engine does, and reports the norm even with clipping off."""
    from services.trainer.engines.megatron.engine import MegatronEngine

    engine = MegatronEngine.__new__(MegatronEngine)
    engine._step = 0
    engine.optimizer = nan = _Bf16MegatronOptimizer(float("nan"))
    engine._optimizer_step(1e-3)
    assert not nan.stepped, "megatron's optimizer stepped on a NaN gradient norm"
    assert engine._optimizer_step(1e-3)[0] is False
    engine.optimizer = ok = _Bf16MegatronOptimizer(2.5, clip_grad=0.0)
    assert engine._optimizer_step(1e-3) == (True, 2.5) and ok.stepped and ok.param_groups[0]["lr"] == 1e-3


def test_megatrons_loss_scale_reaches_the_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """In fp16 megatron's optimizer unscales every gradient by 1 / its loss scale (2**32 at the
    start, growing while nothing overflows); the schedule multiplies each micro-batch's loss by
    it only through `config.grad_scale_func`, which Megatron-LM's training loop sets to
    `optimizer.scale_loss`. Unset, an fp16 run backpropagated unscaled losses (small gradients
    underflow in fp16) and stepped on gradients 2**32 times too small, with a grad norm to match.
    CUDA-only in megatron, hence the stand-in optimizer."""
    from types import SimpleNamespace

    import megatron.core.optimizer as mopt
    import torch

    from services.trainer.engines.megatron.config import MegatronEngineConfig
    from services.trainer.engines.megatron.engine import MegatronEngine

    class Fp16Optimizer:
        def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
            return loss * 2.0**16  # megatron's DynamicGradScaler, after some overflows

    built: list = []
    monkeypatch.setattr(mopt, "get_megatron_optimizer", lambda cfg, model: built.append(cfg) or Fp16Optimizer())
    engine = MegatronEngine.__new__(MegatronEngine)
    engine.cfg = MegatronEngineConfig(model_path="unused", dtype="float16")
    engine.device_kind, engine.model, engine.tcfg = "cuda", [], SimpleNamespace(grad_scale_func=None)
    opt = engine._build_optimizer()
    assert built[0].fp16 and isinstance(opt, Fp16Optimizer)
    # what megatron's backward_step (schedules.py) does with the last stage's loss
    scale = engine.tcfg.grad_scale_func
    assert scale is not None, "the schedule backpropagates the unscaled loss"
    assert float(scale(torch.tensor(3.0))) == 3.0 * 2.0**16
