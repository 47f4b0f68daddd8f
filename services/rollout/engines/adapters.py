"""LoRA adapter versions in the transformers engine: applied in place to the running model.

The first adapter version injects peft's LoRA layers into the model (`inject_adapter_in_model`,
the same layers the trainer's PeftModel runs, so trainer and rollout compute the same function);
every version after it copies its lora_A / lora_B tensors into those layers, by name, as full
weights are copied (no rebuild; with pause("keep") the KV computed under the old adapter is kept).

Before anything is copied the version's descriptor (services/weights/adapter.py) is checked: an
adapter trained on another base is refused with FailedPrecondition naming both bases, and one of
another shape (rank, alpha, targets) than the layers already injected likewise; a refused version
changes nothing. Called only from the scheduler thread (transformers_scheduler.py).
"""

from __future__ import annotations

from typing import Any

import torch

from services.common.errors import FailedPrecondition, InvalidArgument, MissingDependency
from services.weights import Bucket
from services.weights.adapter import (
    AdapterSpec,
    base_identity_for,
    base_identity_of_module,
    check_base,
    model_label,
    module_param_name,
    peft_target_modules,
)

# peft LoraConfig fields an adapter's saved config may set that shape the injected layers.
_LAYER_FIELDS = (
    "exclude_modules", "fan_in_fan_out", "use_rslora", "use_dora", "layers_to_transform", "layers_pattern",
    "rank_pattern", "alpha_pattern", "lora_bias",
)


def _layer_config(spec: AdapterSpec) -> dict[str, Any]:
    """The fields besides rank, alpha and targets that shape (and scale) the injected layers,
    left out where they are unset (None, False, empty). By identity: `layers_to_transform: 0`
    (layer 0 only) equals False but is a layer set."""
    out: dict[str, Any] = {}
    for k in _LAYER_FIELDS:
        v = spec.peft_config.get(k)
        if v is None or v is False or (isinstance(v, dict | list | tuple | str) and not v):
            continue
        out[k] = v
    return out


class InPlaceLoRA:
    """The adapter state of one in-memory HF model (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.spec: AdapterSpec | None = None
        self._base: str | None = None
        self._params: dict[str, torch.Tensor] = {}
        self._seen: set[str] = set()
        self._replaced = False  # full weights replaced the checkpoint's: identify the base in memory

    @property
    def base_model(self) -> str:
        """This model's base identity (computed once, before any adapter is injected)."""
        if self._base is None:
            path = getattr(self.model.config, "_name_or_path", None)
            # after a full-weight version the checkpoint's files no longer describe the weights
            self._base = (base_identity_of_module(self.model, model_label(path)) if self._replaced
                          else base_identity_for(self.model, path))
        return self._base

    def load(self, spec: AdapterSpec, bucket: Bucket, *, first: bool, last: bool) -> int:
        """Copy one bucket of adapter `spec` into the model. `first`: the version's first bucket
        (checks, injects on first use); `last`: the version is complete (checks every adapter
        weight arrived)."""
        injected = False
        if first:
            check_base(spec, self.base_model)
            if self.spec is None:
                self._inject(spec)
                injected = True
            elif not self.spec.same_shape(spec) or _layer_config(self.spec) != _layer_config(spec):
                raise FailedPrecondition(
                    f"adapter of rank {spec.rank}, alpha {spec.alpha} on {sorted(spec.target_modules)} "
                    f"({_layer_config(spec)}) does not fit the injected one (rank {self.spec.rank}, alpha "
                    f"{self.spec.alpha} on {sorted(self.spec.target_modules)}, {_layer_config(self.spec)}); "
                    "restart the rollout to change the LoRA shape"
                )
            self._seen = set()
        # Every tensor of the bucket checked before any is copied: a refused bucket changes nothing
        # (a first adapter's layers, injected for the check, are taken out again).
        try:
            targets = self._targets(bucket)
        except InvalidArgument:
            if injected:
                self._uninject()
            raise
        for (key, target), (_, tensor) in zip(targets, bucket, strict=True):
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            self._seen.add(key)
        if last and len(self._seen) != len(self._params):
            missing = sorted(set(self._params) - self._seen)
            raise InvalidArgument("weights", f"adapter version lacks {len(missing)} LoRA tensors, e.g. {missing[:3]}")
        return len(bucket)

    def _targets(self, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        targets = []
        for name, tensor in bucket:
            key = module_param_name(name)
            target = self._params.get(key)
            if target is None:
                raise InvalidArgument("weights", f"adapter tensor {name!r} has no LoRA layer in {type(self.model).__name__}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise InvalidArgument(
                    "weights", f"{name}: shape {tuple(tensor.shape)} does not match the layer's {tuple(target.shape)}"
                )
            targets.append((key, target))
        return targets

    def base_replaced(self) -> None:
        """Full weights are being loaded: the adapter stops acting (lora_B = 0 makes it the
        identity) and the base's identity is taken again at the next adapter."""
        for key, t in self._params.items():
            if ".lora_B." in key:
                t.zero_()
        self._base = None
        self._replaced = True

    def _inject(self, spec: AdapterSpec) -> None:
        try:
            import peft
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise MissingDependency("LoRA adapters in the transformers rollout engine", f"install meshrl[lora]; {exc}") from exc
        extra = {k: spec.peft_config[k] for k in _LAYER_FIELDS if spec.peft_config.get(k) is not None}
        alpha: Any = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha  # peft types it int
        config = peft.LoraConfig(r=spec.rank, lora_alpha=alpha, target_modules=peft_target_modules(spec),
                                 lora_dropout=0.0, bias="none", **extra)
        _ = self.base_model  # fixed before the model changes
        peft.inject_adapter_in_model(config, self.model)
        named = dict(self.model.named_parameters())
        self._params = {k: p.data for k, p in named.items() if ".lora_A." in k or ".lora_B." in k}
        for k in self._params:
            named[k].requires_grad_(False)
        self.spec = spec

    def _uninject(self) -> None:
        """Put every injected LoRA layer's base layer back (peft's unload without a merge)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        for name, module in list(self.model.named_modules()):
            if isinstance(module, BaseTunerLayer):
                parent_name, _, child = name.rpartition(".")
                setattr(self.model.get_submodule(parent_name), child, module.get_base_layer())
        if "peft_config" in vars(self.model):  # what inject_adapter_in_model recorded
            del self.model.peft_config
        self._params = {}
        self.spec = None
