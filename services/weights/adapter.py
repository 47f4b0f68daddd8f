"""Adapter-only weight versions (LoRA): what a producer puts in front of the adapter's tensors, how
a consumer recognises it, and which base model it applies to. No Ray, no gRPC, no peft.

A LoRA version is an ordinary version whose first tensor (bucket 0, position 0) is the adapter's
descriptor: a uint8 tensor named `DESCRIPTOR_NAME` holding canonical JSON (`AdapterSpec`). The
other tensors are the adapter's weights under PEFT's saved names
(`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`), i.e. what
`adapter_model.safetensors` holds. Because the descriptor is a tensor, every transport carries it
without knowing about adapters, and the bucket fingerprints and the manifest checksum cover it;
the manifest's `adapter` field is read from it when the manifest is built (services/weights/
transports/base.py), so the param server and `GetManifest` say what the version is.

Base identity. An adapter only makes sense on the exact base weights it was trained against. The
base is named by `label:digest`, where the digest is a sha256 over the sorted, distinct sha256s
of a sample of every floating tensor of the base, rounded to bfloat16: one-dimensional tensors
(norm weights, biases) whole, others by their first row. A fine-tune changes them; they are a
small fraction of the bytes (a checkpoint's files are read only there); the rounding makes the
digest the same whether a side holds the weights in fp32, bf16 or fp16; names do not enter and
repeats count once (a tied output head is its embedding). Both sides take the same source: the
checkpoint directory's safetensors files when the model has one (`base_identity_for`), else the
in-memory weights (a model built in code, as the built-in tiny one). Consumers compare digests
only; the label (checkpoint directory name) is for people.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common.errors import FailedPrecondition, InvalidArgument

from .protocols import Bucket

DESCRIPTOR_NAME = "meshrl.adapter"
"""The descriptor tensor's name (not a valid module path, so it never collides with a weight)."""
PEFT_PREFIX = "base_model.model."
"""What PEFT's saved names put in front of the base model's module path."""


@dataclass(frozen=True)
class AdapterSpec:
    """What a consumer needs to apply an adapter version, besides its tensors."""

    base_model: str
    """The base's identity, `label:digest` (see the module docstring)."""
    rank: int
    """LoRA rank r."""
    alpha: float
    """LoRA alpha (the update is alpha / r * B @ A)."""
    target_modules: tuple[str, ...]
    """Modules that carry an adapter, as peft resolved them (never `all-linear`): names or module
    paths, matched by suffix."""
    peft_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """PEFT's adapter_config.json content (what vLLM and peft load)."""

    def to_json(self) -> bytes:
        doc = {
            "base_model": self.base_model, "rank": self.rank, "alpha": self.alpha,
            "target_modules": list(self.target_modules), "peft_config": self.peft_config,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> AdapterSpec:
        try:
            doc = json.loads(raw)
            return cls(
                base_model=str(doc["base_model"]), rank=int(doc["rank"]), alpha=float(doc["alpha"]),
                target_modules=tuple(str(m) for m in doc["target_modules"]), peft_config=dict(doc["peft_config"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(DESCRIPTOR_NAME, f"not a meshrl adapter descriptor: {exc}") from None

    def same_shape(self, other: AdapterSpec) -> bool:
        """Whether `other` fits the modules built for this one (same rank, alpha and targets)."""
        return (self.rank, self.alpha, set(self.target_modules)) == (other.rank, other.alpha, set(other.target_modules))


def peft_target_modules(spec: AdapterSpec) -> str | list[str]:
    """`target_modules` as peft must be given it: a regex string stays a string (peft fullmatches
    it against module paths; as a one-element list it would be taken as a module name)."""
    saved = spec.peft_config.get("target_modules")
    return saved if isinstance(saved, str) else list(spec.target_modules)


def descriptor(spec: AdapterSpec) -> tuple[str, torch.Tensor]:
    """The descriptor tensor that opens an adapter version."""
    return DESCRIPTOR_NAME, torch.frombuffer(bytearray(spec.to_json()), dtype=torch.uint8)


def split_descriptor(bucket: Bucket) -> tuple[AdapterSpec | None, Bucket]:
    """(the spec, the remaining tensors) when `bucket` opens with a descriptor, else (None, bucket).
    A descriptor anywhere else is an error: a consumer must know what a version is before it
    loads any of it."""
    if bucket and bucket[0][0] == DESCRIPTOR_NAME:
        raw = bucket[0][1].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        rest = bucket[1:]
        if any(name == DESCRIPTOR_NAME for name, _ in rest):
            raise InvalidArgument(DESCRIPTOR_NAME, "appears twice in one version")
        return AdapterSpec.from_json(raw), rest
    if any(name == DESCRIPTOR_NAME for name, _ in bucket):
        raise InvalidArgument(DESCRIPTOR_NAME, "must be the first tensor of the first bucket")
    return None, bucket


def check_base(spec: AdapterSpec, own_base: str) -> None:
    """FailedPrecondition naming both bases when `spec` was trained on another base than `own_base`."""
    if digest_of(spec.base_model) != digest_of(own_base):
        raise FailedPrecondition(
            f"adapter version is for base model {spec.base_model!r} but this rollout serves {own_base!r}; "
            "start the rollout from the trainer's actor_rollout_ref.model.path (the same base weights)"
        )


def digest_of(base_model: str) -> str:
    return base_model.rpartition(":")[2]


# ---- base identity ------------------------------------------------------------------------------


def base_identity(samples: Iterable[torch.Tensor], label: str) -> str:
    """`label:digest` over tensor samples (`sample(t)` of each weight; see the module docstring);
    non-floating samples are skipped."""
    digests = set()
    for t in samples:
        if t.dim() == 0 or not t.is_floating_point():
            continue
        rounded = t.detach().to("cpu", torch.bfloat16).contiguous()
        digests.add(hashlib.sha256(rounded.view(torch.uint8).numpy().tobytes()).hexdigest())
    if not digests:
        raise InvalidArgument("base model", "has no floating-point weights to identify it by")
    total = hashlib.sha256("".join(sorted(digests)).encode()).hexdigest()[:32]
    return f"{label}:{total}"


def sample(t: torch.Tensor) -> torch.Tensor:
    """What of a weight enters its base's identity: a vector whole, else its first row."""
    return t if t.dim() <= 1 else t[0]


def model_label(path: str | os.PathLike[str] | None) -> str:
    """The human part of a base identity: the checkpoint directory's name, or `builtin`."""
    if not path:
        return "builtin"
    return Path(path).resolve().name or str(path)


def base_identity_of_module(model: Any, label: str) -> str:
    """The identity of an in-memory (HF) model's weights (LoRA weights injected into it skipped)."""
    return base_identity((sample(t) for k, t in model.state_dict().items() if ".lora_" not in k), label)


def base_identity_of_dir(path: str | os.PathLike[str]) -> str:
    """The identity of a checkpoint directory, read from its safetensors files (only the sampled
    rows are read)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FailedPrecondition(f"{path}: no *.safetensors files to identify the base model by")

    def samples() -> Iterable[torch.Tensor]:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    sl = st.get_slice(key)
                    yield sl[:] if len(sl.get_shape()) <= 1 else sl[0:1][0]

    return base_identity(samples(), model_label(path))


def has_checkpoint_files(path: str | os.PathLike[str] | None) -> bool:
    return bool(path) and Path(str(path)).is_dir() and any(Path(str(path)).glob("*.safetensors"))


def base_identity_for(model: Any, path: str | os.PathLike[str] | None) -> str:
    """The rule both sides follow: the checkpoint's files when `path` holds them, else `model`
    in memory."""
    if has_checkpoint_files(path):
        assert path is not None
        return base_identity_of_dir(path)
    return base_identity_of_module(model, model_label(path))


# ---- PEFT names and files -----------------------------------------------------------------------


def module_param_name(peft_name: str, adapter_name: str = "default") -> str:
    """PEFT's saved name -> the parameter's name inside a model that peft injected adapter
    `adapter_name` into (`model.layers.0.q_proj.lora_A.weight` -> `...lora_A.default.weight`)."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        marker = f".{part}."
        if marker in name:
            head, _, tail = name.partition(marker)
            return f"{head}.{part}.{adapter_name}.{tail}"
    raise InvalidArgument("adapter tensors", f"{peft_name!r} is not a LoRA weight (lora_A / lora_B)")


def saved_name(param_name: str, adapter_name: str = "default") -> str:
    """The inverse of `module_param_name` for a PeftModel's parameter names
    (`base_model.model.<module>.lora_A.default.weight` -> `base_model.model.<module>.lora_A.weight`)."""
    name = param_name.replace(f".{adapter_name}.", ".")
    return name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name


def write_peft_dir(spec: AdapterSpec, tensors: Sequence[tuple[str, torch.Tensor]], path: str | os.PathLike[str]) -> Path:
    """An adapter directory that peft (`PeftModel.from_pretrained`) and vLLM (`LoRARequest`) load:
    adapter_config.json and adapter_model.safetensors. Files are replaced atomically, so a reader
    never sees half of one."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(spec.peft_config)
    config.setdefault("peft_type", "LORA")
    config["r"], config["lora_alpha"], config["target_modules"] = spec.rank, spec.alpha, peft_target_modules(spec)
    tmp_cfg, tmp_st = out / ".adapter_config.json.tmp", out / ".adapter_model.safetensors.tmp"
    tmp_cfg.write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors}, str(tmp_st),
              metadata={"format": "pt", "meshrl_base_model": spec.base_model})
    os.replace(tmp_st, out / "adapter_model.safetensors")
    os.replace(tmp_cfg, out / "adapter_config.json")
    return out
