"""The `megatron` config section, the TransformerConfig / OptimizerConfig mapping with overrides
(applied, unknown keys named), and the architecture facts the plan and the engine share."""

from __future__ import annotations

import pytest

from services.common.config import load_config
from services.common.config.actor_rollout_ref import MegatronConfig, OptimConfig
from services.common.errors import ConfigError
from services.common.model_arch import KNOWN_CONFIGS, ModelArch, load_arch

pytest.importorskip("megatron.core")

from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig

from services.trainer.engines.megatron.mcore_config import (
    build_dataclass,
    optimizer_config_kwargs,
    transformer_config_kwargs,
)


def test_config_tree_has_verl_megatron_keys() -> None:
    cfg = load_config(None, [
        "actor_rollout_ref.actor.strategy=megatron",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
        "actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=11",
        "actor_rollout_ref.actor.megatron.override_optimizer_config.optimizer_offload_fraction=1",
        "actor_rollout_ref.ref.megatron.param_offload=true",
    ])
    m = cfg.actor_rollout_ref.actor.megatron
    assert m.tensor_model_parallel_size == 4 and m.model_parallel_size == 4
    assert m.override_transformer_config == {"num_layers_in_first_pipeline_stage": 11}
    assert cfg.actor_rollout_ref.ref.megatron.param_offload
    with pytest.raises(ConfigError, match="tensor_model_parallel_size"):
        load_config(None, ["actor_rollout_ref.actor.megatron.tensor_model_paralel_size=2"])


def test_transformer_overrides_are_applied_and_checked() -> None:
    arch = ModelArch.from_hf_config(KNOWN_CONFIGS["Qwen/Qwen3-30B-A3B"])
    m = MegatronConfig(
        tensor_model_parallel_size=4, pipeline_model_parallel_size=8, expert_model_parallel_size=4,
        override_transformer_config={
            "num_layers_in_first_pipeline_stage": 6, "num_layers_in_last_pipeline_stage": 6,
            "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01,
        },
    )
    base = transformer_config_kwargs(arch, m, dtype="bfloat16", cpu=False)
    tc = build_dataclass(TransformerConfig, base, m.override_transformer_config, "override_transformer_config")
    assert tc.num_layers_in_first_pipeline_stage == 6 and tc.recompute_granularity == "full"
    assert tc.moe_aux_loss_coeff == 0.01 and tc.num_moe_experts == 128 and tc.moe_router_topk == 8
    assert tc.num_query_groups == 4 and tc.kv_channels == 128 and tc.moe_ffn_hidden_size == 768
    assert tc.sequence_parallel and tc.expert_tensor_parallel_size == 4
    backend = build_dataclass(TransformerConfig, base, {"attention_backend": "local"}, "override_transformer_config")
    assert backend.attention_backend.name == "local"  # YAML string -> megatron's AttnBackend enum
    with pytest.raises(ConfigError, match="attention_backend='fast' is not one of"):
        build_dataclass(TransformerConfig, base, {"attention_backend": "fast"}, "override_transformer_config")
    with pytest.raises(ConfigError, match=r"'recompute_granularty'.*did you mean 'recompute_granularity'"):
        build_dataclass(TransformerConfig, base, {"recompute_granularty": "full"}, "override_transformer_config")
    with pytest.raises(ConfigError, match="megatron-core rejected"):
        # 48 layers - 4 - 6 = 38 do not split over 6 middle stages.
        build_dataclass(TransformerConfig, base, {**m.override_transformer_config, "num_layers_in_first_pipeline_stage": 4},
                        "override_transformer_config")


def test_optimizer_overrides_are_applied() -> None:
    m = MegatronConfig(optimizer_offload=True, override_optimizer_config={"overlap_cpu_optimizer_d2h_h2d": True, "lr": 3e-6})
    kw = optimizer_config_kwargs(OptimConfig(lr=1e-6, weight_decay=0.1), m, dtype="bfloat16", grad_clip=1.0)
    oc = build_dataclass(OptimizerConfig, kw, m.override_optimizer_config, "override_optimizer_config")
    assert oc.optimizer_cpu_offload and oc.optimizer_offload_fraction == 1.0 and oc.overlap_cpu_optimizer_d2h_h2d
    assert oc.lr == 3e-6 and oc.weight_decay == 0.1 and oc.use_distributed_optimizer
    with pytest.raises(ConfigError, match="OptimizerConfig"):
        build_dataclass(OptimizerConfig, kw, {"optimiser": "adam"}, "override_optimizer_config")
    from services.trainer.engines.megatron.mcore_config import has_transformer_engine

    if not has_transformer_engine():
        with pytest.raises(ConfigError, match="use_precision_aware_optimizer=true needs NVIDIA Transformer Engine"):
            build_dataclass(OptimizerConfig, kw, {"use_precision_aware_optimizer": True}, "override_optimizer_config")


def test_architecture_table_and_local_config(tmp_path) -> None:
    a = load_arch("Qwen/Qwen3-235B-A22B")
    assert (a.num_layers, a.num_experts, a.hidden_size, a.vocab_size) == (94, 128, 4096, 151936)
    assert 230e9 < a.total_params < 240e9, a.total_params  # "235B"
    assert 29e9 < load_arch("Qwen3-30B-A3B").total_params < 31.5e9
    assert 8.0e9 < load_arch("Qwen/Qwen3-8B").total_params < 8.4e9
    q35 = load_arch("Qwen/Qwen3.5-122B-A10B")
    assert q35.has_linear_attention and q35.num_linear_attention_layers == 36 and not q35.verified
    from services.common.tiny import build_tiny_model, build_tokenizer, save_pretrained_pair

    save_pretrained_pair(build_tiny_model("qwen3_moe", build_tokenizer()), build_tokenizer(), tmp_path)
    local = load_arch(str(tmp_path))
    assert local.model_type == "qwen3_moe" and local.num_experts == 4 and local.moe_layers == (True, True)
    with pytest.raises(ConfigError, match="neither a directory"):
        load_arch("Qwen/Qwen9-1T")


def test_optimizer_offload_with_fp32_distributed_optimizer_is_refused() -> None:
    """megatron-core 0.16 cannot offload fp32 parameter shards (non-leaf views); bf16 is fine, and
    on CPU the engine runs torch AdamW without offload."""
    from services.trainer.engines.megatron.config import MegatronEngineConfig

    m = MegatronConfig(optimizer_offload=True, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match=r"optimizer_offload.*model.dtype=bfloat16"):  # pydantic wraps ConfigError
        MegatronEngineConfig(model_path="/x", device="cuda", dtype="float32", megatron=m)
    assert MegatronEngineConfig(model_path="/x", device="cuda", dtype="bfloat16", megatron=m).megatron.optimizer_offload
    assert MegatronEngineConfig(model_path="/x", device="cpu", dtype="float32", megatron=m)


@pytest.mark.parametrize(("optim", "total"), [
    (OptimConfig(lr_scheduler_type="cosine"), 0),  # an open-ended run (total_steps 0 never stops)
    (OptimConfig(lr_scheduler_type="linear", lr_warmup_steps=10), 5),  # warmup over the whole run
])
def test_an_lr_schedule_without_room_is_refused_as_the_fsdp_engine_refuses_it(optim: OptimConfig, total: int) -> None:
    """The FSDP engine refuses these (optim.lr_lambda); the megatron engine clamped the total to
    1, so a cosine schedule of an open-ended run decayed to min_lr (0 by default) after one step."""
    from types import SimpleNamespace

    from services.common.config.actor_rollout_ref import ActorConfig, ModelConfig
    from services.trainer.engines.megatron.config import MegatronEngineConfig

    spec = SimpleNamespace(
        model=ModelConfig(path="/nonexistent"), actor=ActorConfig(strategy="megatron", optim=optim), ref=None,
        device="cpu", total_training_steps=total, log_prob_micro_batch_size_per_gpu=None, seed=1,
    )
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.optim"):
        MegatronEngineConfig.from_spec(spec)
    spec.total_training_steps = 100
    assert MegatronEngineConfig.from_spec(spec).total_training_steps == 100


def _megatron_spec(**actor: object) -> object:
    from types import SimpleNamespace

    from services.common.config.actor_rollout_ref import ActorConfig, ModelConfig

    return SimpleNamespace(
        model=ModelConfig(path="/nonexistent"), actor=ActorConfig(strategy="megatron", **actor), ref=None,
        device="cpu", total_training_steps=100, log_prob_micro_batch_size_per_gpu=None, seed=1,
    )


@pytest.mark.parametrize("clip", [0.0, -1.0])
def test_grad_clip_of_zero_means_no_clipping_as_in_the_fsdp_engine(clip: float) -> None:
    """actor.grad_clip <= 0 is "no clipping" in the FSDP engine and in megatron's optimizer; the
    megatron engine config refused it with a pydantic error naming its own `grad_clip` field."""
    from services.trainer.engines.megatron.config import MegatronEngineConfig

    cfg = MegatronEngineConfig.from_spec(_megatron_spec(grad_clip=clip))
    kw = optimizer_config_kwargs(cfg.optim, cfg.megatron, dtype="float32", grad_clip=cfg.grad_clip)
    assert build_dataclass(OptimizerConfig, kw, {}, "override_optimizer_config").clip_grad <= 0.0


@pytest.mark.parametrize("optim", [
    OptimConfig(lr=1e-3),
    OptimConfig(lr=1e-3, lr_warmup_steps=3),
    OptimConfig(lr=1e-3, lr_warmup_steps_ratio=0.1),
    OptimConfig(lr=1e-3, lr_scheduler_type="cosine", lr_warmup_steps=3, min_lr_ratio=0.1),
    OptimConfig(lr=1e-3, lr_scheduler_type="cosine", lr_warmup_steps_ratio=0.2, num_cycles=1.5),
    OptimConfig(lr=1e-3, lr_scheduler_type="cosine"),
    OptimConfig(lr=1e-3, lr_scheduler_type="linear", lr_warmup_steps=3, min_lr_ratio=0.2),
    OptimConfig(lr=1e-3, lr_scheduler_type="linear"),
])
@pytest.mark.parametrize("total", [1, 7, 40])
def test_megatron_lr_schedule_equals_the_fsdp_engines_at_every_step(optim: OptimConfig, total: int) -> None:
    """Both engines step the LR through one schedule (optim.lr_lambda), so a run switched between
    them, or resumed on the other, sees the same LR at every step, past the end included."""
    import torch

    from services.common.errors import ConfigError as _CE
    from services.trainer.engines.megatron.schedule import lr_at
    from services.trainer.engines.optim import build_optimizer

    try:
        opt, sched = build_optimizer([torch.nn.Parameter(torch.zeros(1))], optim, total)
    except _CE:
        pytest.skip("schedule refused for this total (warmup covers the run)")
    for step in range(total + 3):
        assert lr_at(optim, step, total) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=0), step
        opt.step()
        sched.step()
