"""Adapter versions for the LoRA tests: a peft adapter on the tiny model with random (non-zero)
weights, as the bucket a trainer would publish, and the HF model that computes the same function
(for reference logprobs)."""

from __future__ import annotations

from typing import Any

import torch

from services.weights import Bucket
from services.weights.adapter import AdapterSpec, base_identity_of_module, descriptor, model_label, saved_name


def random_adapter(base: Any, *, rank: int = 8, alpha: int = 16, seed: int = 0, scale: float = 0.3) -> tuple[Bucket, Any]:
    """(the adapter version's single bucket, a peft model of `base` + that adapter). `base` is
    copied, not changed."""
    import copy

    from peft import LoraConfig, get_peft_model

    from services.trainer.engines.fsdp_lora import spec_of

    base_id = base_identity_of_module(base, model_label(None))
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear",
                                                            lora_dropout=0.0, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.eval()
    spec: AdapterSpec = spec_of(model, base_id, None)
    bucket: Bucket = [descriptor(spec)]
    bucket += [(saved_name(n), p.detach().clone()) for n, p in model.named_parameters() if ".lora_" in n]
    return bucket, model
