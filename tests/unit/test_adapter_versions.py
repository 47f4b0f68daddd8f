"""Adapter-only weight versions (services/weights/adapter.py): the descriptor, the manifest's
adapter field, the base identity, PEFT names, and vLLM's LoRA arguments."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.common.config.actor_rollout_ref import RolloutEngineConfig
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.tiny import build_tiny_model, build_tokenizer, save_pretrained_pair
from services.rollout.engines.vllm_args import engine_args_from_config
from services.weights import convert
from services.weights.adapter import (
    DESCRIPTOR_NAME,
    AdapterSpec,
    base_identity_for,
    base_identity_of_dir,
    base_identity_of_module,
    check_base,
    descriptor,
    module_param_name,
    saved_name,
    split_descriptor,
)
from services.weights.layout import validate_manifest
from services.weights.transports.base import ManifestBuilder, plan_buckets

pytestmark = pytest.mark.unit

SPEC = AdapterSpec(base_model="Qwen3-8B:" + "ab" * 16, rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"),
                   peft_config={"r": 8, "lora_alpha": 16, "peft_type": "LORA"})


def _version() -> list[list[tuple[str, torch.Tensor]]]:
    a = ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.randn(8, 16))
    b = ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(16, 8))
    return [[descriptor(SPEC), a], [b]]


def test_descriptor_opens_the_version_and_nowhere_else() -> None:
    first = _version()[0]
    spec, rest = split_descriptor(first)
    assert spec == SPEC and spec.peft_config == SPEC.peft_config and [n for n, _ in rest] == [first[1][0]]
    assert split_descriptor(rest) == (None, rest)
    with pytest.raises(InvalidArgument, match="first tensor"):
        split_descriptor([first[1], first[0]])
    with pytest.raises(InvalidArgument, match="twice"):
        split_descriptor([first[0], first[0]])
    with pytest.raises(InvalidArgument, match="not a meshrl adapter descriptor"):
        split_descriptor([(DESCRIPTOR_NAME, torch.frombuffer(bytearray(b"{}"), dtype=torch.uint8))])


def test_the_manifest_says_which_base_an_adapter_applies_to() -> None:
    async def build(buckets: list) -> object:
        builder = ManifestBuilder(3)
        async for planned in plan_buckets(buckets):
            builder.add(planned, "00" * 16)
        return builder.build(["grpc"])

    m = asyncio.run(build(_version()))
    assert m.adapter is not None and m.adapter.base_model == SPEC.base_model and m.adapter.rank == 8  # type: ignore[attr-defined]
    assert m.tensors[0].name == DESCRIPTOR_NAME  # type: ignore[attr-defined]
    proto = convert.manifest_to_proto(m)  # type: ignore[arg-type]
    assert proto.adapter.base_model == SPEC.base_model and list(proto.adapter.target_modules) == ["q_proj", "v_proj"]
    back = convert.manifest_from_proto(proto)
    assert back == m and back.adapter == SPEC  # peft_config does not travel in the manifest (the tensor has it)
    validate_manifest(back)
    full = asyncio.run(build([[("model.norm.weight", torch.ones(4))]]))
    assert full.adapter is None and not convert.manifest_to_proto(full).HasField("adapter")  # type: ignore[attr-defined, arg-type]


def test_base_identity_follows_the_weights_not_their_dtype_or_names(tmp_path: Path) -> None:
    tok = build_tokenizer()
    a = build_tiny_model("qwen3", tok, seed=0)
    ident = base_identity_of_module(a, "x")
    assert base_identity_of_module(build_tiny_model("qwen3", tok, seed=0).to(torch.bfloat16), "y").split(":")[1] == ident.split(":")[1]
    assert base_identity_of_module(build_tiny_model("qwen3", tok, seed=1), "x") != ident
    save_pretrained_pair(a, tok, tmp_path / "ckpt")  # tied head saved once; names as in the files
    on_disk = base_identity_of_dir(tmp_path / "ckpt")
    assert on_disk == f"ckpt:{ident.split(':')[1]}" == base_identity_for(a, str(tmp_path / "ckpt"))
    assert base_identity_for(a, None) == f"builtin:{ident.split(':')[1]}"
    check_base(SPEC, "other-name:" + "ab" * 16)  # digests equal: the label is for people
    with pytest.raises(FailedPrecondition) as info:
        check_base(SPEC, ident)
    assert SPEC.base_model in str(info.value) and ident in str(info.value)


def test_peft_names_round_trip() -> None:
    saved = "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"
    inside = module_param_name(saved)
    assert inside == "model.layers.3.mlp.down_proj.lora_B.default.weight"
    assert saved_name("base_model.model." + inside) == saved
    with pytest.raises(InvalidArgument, match="not a LoRA weight"):
        module_param_name("base_model.model.model.norm.weight")


def test_vllm_gets_lora_arguments_only_with_a_rank() -> None:
    rollout = RolloutEngineConfig()
    assert "enable_lora" not in engine_args_from_config("/m", rollout)
    args = engine_args_from_config("/m", rollout, lora_rank=12)
    assert args["enable_lora"] is True and args["max_loras"] == 1 and args["max_lora_rank"] == 16
