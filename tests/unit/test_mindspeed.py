"""MindSpeed (NPU) without an NPU: the patch plan and config mapping as pure functions, the
inheritance of the megatron engine's config checks, fail-fast errors, THD preprocessing."""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from services.common import device
from services.common.config.actor_rollout_ref import MegatronConfig
from services.common.errors import ConfigError, MissingDependency
from services.trainer.engines.mindspeed.packing import (
    context_parallel_merge,
    context_parallel_split,
    mindspeed_inputs,
    pack,
    pack_layout,
    thd_alignment,
    unpack,
)
from services.trainer.engines.mindspeed.patches import MINDSPEED_FLAGS, build_patch_plan

TFIELDS = {"recompute_granularity", "recompute_method", "recompute_num_layers", "attention_backend",
           "num_layers_in_first_pipeline_stage", "moe_token_dispatcher_type"}


def test_patch_plan_splits_overrides_like_verl() -> None:
    m = MegatronConfig(
        tensor_model_parallel_size=4, context_parallel_size=2,
        override_transformer_config={"recompute_granularity": "full", "use_fused_rmsnorm": True, "attention_backend": "flash"},
    )
    plan = build_patch_plan(m, TFIELDS)
    assert plan.transformer_overrides == {"recompute_granularity": "full", "attention_backend": "flash"}
    assert plan.repatch["use_fused_rmsnorm"] is True and plan.repatch["use_flash_attn"] is True
    assert plan.repatch["context_parallel_size"] == 2 and plan.repatch["context_parallel_algo"] == "megatron_cp_algo"
    assert plan.repatch["tensor_model_parallel_size"] == 4 and plan.repatch["sequence_parallel"] is True
    assert "recompute_granularity" not in plan.repatch


def test_batch_invariant_turns_flash_attention_off_and_conflicts_are_named() -> None:
    plan = build_patch_plan(MegatronConfig(override_transformer_config={"use_flash_attn_npu_batch_invariant": True}), TFIELDS)
    assert plan.repatch["use_flash_attn"] is False and "context_parallel_size" not in plan.repatch
    with pytest.raises(ConfigError, match="use_flash_attn=false"):
        build_patch_plan(MegatronConfig(override_transformer_config={
            "use_flash_attn_npu_batch_invariant": True, "use_flash_attn": True}), TFIELDS)


def test_unknown_override_key_is_rejected_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"use_fused_rmsnrom.*did you mean 'use_fused_rmsnorm'"):
        build_patch_plan(MegatronConfig(override_transformer_config={"use_fused_rmsnrom": True}), TFIELDS)
    assert "use_flash_attn" in MINDSPEED_FLAGS


def test_mindspeed_config_runs_parent_validators_then_its_own(tmp_path) -> None:
    pytest.importorskip("megatron.core")
    from services.trainer.engines.mindspeed.config import MindSpeedEngineConfig

    ok = MindSpeedEngineConfig(model_path=str(tmp_path), megatron=MegatronConfig(
        override_transformer_config={"use_fused_swiglu": True, "recompute_granularity": "full"}))
    assert ok.device == "npu" and ok.plan.repatch["use_fused_swiglu"] is True
    assert ok.plan.transformer_overrides == {"recompute_granularity": "full"}
    # A parent (megatron) check still fires for the MindSpeed config: ref layout must equal the actor's.
    with pytest.raises(ValueError, match=r"ref\.megatron\.tensor_model_parallel_size"):
        MindSpeedEngineConfig(model_path=str(tmp_path), megatron=MegatronConfig(tensor_model_parallel_size=2),
                              ref_megatron=MegatronConfig())
    # Parent: uneven stage sizes need PP > 1.
    with pytest.raises(ValueError, match="pipeline_model_parallel_size > 1"):
        MindSpeedEngineConfig(model_path=str(tmp_path), megatron=MegatronConfig(
            override_transformer_config={"num_layers_in_first_pipeline_stage": 3}))
    # Child: MindSpeed's own check.
    with pytest.raises(ValueError, match="neither a megatron TransformerConfig field"):
        MindSpeedEngineConfig(model_path=str(tmp_path), megatron=MegatronConfig(override_transformer_config={"bogus": 1}))
    with pytest.raises(ValueError, match="Input should be 'npu'"):
        MindSpeedEngineConfig(model_path=str(tmp_path), device="cuda")


def test_npu_paths_fail_fast_without_cann(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_OPP_PATH"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(MissingDependency, match="CANN"):
        device.require_npu("the test")
    from services.trainer.engines.ascend import require_mindspeed

    with pytest.raises(MissingDependency, match="CANN"):
        require_mindspeed()


def test_mindspeed_engine_construction_fails_fast(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("megatron.core")
    from services.trainer.engines.base import get_engine_cls
    from services.trainer.engines.mindspeed.config import MindSpeedEngineConfig

    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_OPP_PATH"):
        monkeypatch.delenv(var, raising=False)
    cls = get_engine_cls("mindspeed", "npu")
    assert cls is get_engine_cls("megatron", "npu") and cls.backend == "mindspeed"
    with pytest.raises(MissingDependency, match="CANN"):
        cls(MindSpeedEngineConfig(model_path=str(tmp_path)))  # type: ignore[call-arg]


def test_device_npu_plumbing() -> None:
    assert device.collective_backend("npu") == "hccl" and device.ray_resource("npu") == "NPU"
    assert device.ray_actor_resources("npu", 16) == {"resources": {"NPU": 16}}
    assert device.ray_actor_resources("cuda", 1) == {"num_gpus": 1} and device.ray_actor_resources("cpu", 1) == {}
    with pytest.raises(ValueError, match="hccl"):
        device.backend_device_kind("rdma")


def test_hccl_groups_are_created_with_a_connect_timeout_the_operator_may_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # HCCL reads HCCL_CONNECT_TIMEOUT (default 120 s) when a communicator is created: the weight
    # broadcast's group and the trainer's default group set it first; a value already set stays.
    import torch.distributed as dist

    from services.weights.transports.collective import group

    seen: list[str | None] = []
    monkeypatch.setattr(group, "import_torch_npu", lambda: None)
    monkeypatch.setattr(dist, "ProcessGroupHCCL", lambda *a: seen.append(os.environ.get("HCCL_CONNECT_TIMEOUT")),
                        raising=False)
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT", raising=False)
    group._make_backend("hccl", None, 0, 1, datetime.timedelta(seconds=5))
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1800")
    group._make_backend("hccl", None, 0, 1, datetime.timedelta(seconds=5))
    assert seen == ["600", "1800"]
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT")
    device.apply_collective_env("nccl")
    assert "HCCL_CONNECT_TIMEOUT" not in os.environ


def test_thd_layout_for_mindspeed() -> None:
    am = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    layout = pack_layout(am, align=thd_alignment(tp=2, cp=1))
    assert layout.cu_seqlens.tolist() == [0, 3, 8, 9]
    assert layout.cu_seqlens_padded.tolist() == [0, 4, 10, 12]
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1]
    actual, pos = mindspeed_inputs(layout)
    assert actual == [0, 4, 10, 12] and pos.shape == (12, 1) and pos.dtype == torch.int32
    ids = torch.arange(15).view(3, 5)
    packed = pack(ids, layout, fill=-1)
    assert packed.tolist() == [0, 1, 2, -1, 5, 6, 7, 8, 9, -1, 10, -1]
    assert torch.equal(unpack(packed, layout, 3, 5, fill=0), ids * am)
    assert thd_alignment(2, 2) == 8
    with pytest.raises(ValueError, match="right-padded"):
        pack_layout(torch.tensor([[0, 1, 1]]))


def test_context_parallel_split_is_load_balanced_and_invertible() -> None:
    x = torch.arange(2 * 16).view(2, 16)
    parts = [context_parallel_split(x, cp=2, cp_rank=r) for r in range(2)]
    assert parts[0][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert torch.equal(context_parallel_merge(parts), x)
    with pytest.raises(ValueError, match="multiple of 2"):
        context_parallel_split(torch.zeros(1, 6), cp=2, cp_rank=0)


def test_missing_mindspeed_is_reported_once_and_only_on_ascend_hosts(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import builtins

    from structlog.testing import capture_logs

    from services.trainer.engines import ascend

    real_import = builtins.__import__

    def no_mindspeed(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name.startswith("mindspeed"):
            raise ImportError("No module named 'mindspeed'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mindspeed)
    # A GPU/CPU host: nothing attempted, nothing said.
    monkeypatch.setattr(ascend, "_STATE", {})
    monkeypatch.setattr(ascend, "has_ascend_devices", lambda: False)
    with capture_logs() as logs:
        assert ascend.maybe_import_mindspeed() is None
    assert logs == []
    # An Ascend host with CANN but no MindSpeed: one warning, however often it is asked.
    monkeypatch.setattr(ascend, "_STATE", {})
    monkeypatch.setattr(ascend, "has_ascend_devices", lambda: True)
    monkeypatch.setattr(ascend, "cann_home", lambda: str(tmp_path))
    with capture_logs() as logs:
        for _ in range(3):
            assert ascend.maybe_import_mindspeed() is None
    assert [entry["log_level"] for entry in logs] == ["warning"]
    assert "placeholder" in logs[0]["hint"]


def test_engines_build_their_own_config_from_the_run_config(tmp_path) -> None:
    pytest.importorskip("megatron.core")
    from services.common.config import load_config
    from services.trainer.engines.megatron.config import MegatronEngineConfig
    from services.trainer.engines.mindspeed.config import MindSpeedEngineConfig
    from services.trainer.engines.mindspeed.engine import MindSpeedEngine

    cfg = load_config("configs/recipes/qwen3_8b_grpo_mindspeed_npu.yaml", [f"actor_rollout_ref.model.path={tmp_path}"])
    assert MindSpeedEngine.config_cls is MindSpeedEngineConfig
    ms = MindSpeedEngineConfig.from_mesh(cfg, "npu", 200)
    assert ms.ref_megatron is not None and ms.ref_megatron.param_offload  # use_kl_loss -> reference model
    assert ms.plan.repatch["use_fused_swiglu"] is True and ms.total_training_steps == 200
    with pytest.raises(ValueError, match="NPU only"):
        MindSpeedEngineConfig.from_mesh(cfg, "cuda", 200)
    with pytest.raises(ValueError, match=r"is not a field of megatron-core.s TransformerConfig"):
        # On the megatron (GPU) engine MindSpeed flags are not TransformerConfig fields.
        from megatron.core.transformer import TransformerConfig

        from services.trainer.engines.megatron.mcore_config import split_overrides

        split_overrides(MegatronEngineConfig.from_mesh(cfg, "cuda", 1).megatron.override_transformer_config, TransformerConfig)


def test_repatch_gets_attention_backend_as_megatron_enum() -> None:
    """verl: repatch(mapping_string_to_attn_backend(override_transformer_config)) -- MindSpeed's
    repatch sets megatron's global args, where attention_backend is an AttnBackend (megatron's
    argparse converts it), never the YAML string."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import AttnBackend

    plan = build_patch_plan(MegatronConfig(override_transformer_config={"attention_backend": "flash"}), TFIELDS)
    assert plan.repatch["attention_backend"] is AttnBackend.flash
    # The TransformerConfig side keeps the string (build_dataclass coerces it there).
    assert plan.transformer_overrides["attention_backend"] == "flash"
    with pytest.raises(ConfigError, match="attention_backend"):
        build_patch_plan(MegatronConfig(override_transformer_config={"attention_backend": "flsh"}), TFIELDS)
