"""Mixed into every vLLM worker (`worker_extension_cls`); reached through `collective_rpc`.

Runs inside vLLM's worker processes, so it imports only torch, safetensors and vLLM.

- `meshrl_begin_update()` / `meshrl_load_weights(payload)` / `meshrl_finish_update()`: one
  bucket at a time as safetensors bytes (collective_rpc serialises tensors as lists on CPU, bytes
  pass through intact) → `model.load_weights` by HF name (TP-aware in vLLM's model code).
  On CPU vLLM repacks every linear weight for oneDNN after loading and frees the original
  parameter; begin re-creates those parameters, finish checks that the update covered every one
  of them and repacks (`process_weights_after_loading`), the LM head's packed copy included. On
  GPU both are no-ops.
- `meshrl_patch_sampler()`: makes vLLM's `processed_logprobs` mean meshrl's logprob contract,
  log_softmax(logits / temperature) *before* top-k / top-p truncation. vLLM computes processed
  logprobs after truncation (renormalised over the kept tokens), which differs from what the
  trainer recomputes whenever top_k / top_p are active.
"""

from __future__ import annotations

from typing import Any

import torch


class MeshrlWorkerExtension:
    model_runner: Any

    def meshrl_begin_update(self) -> int:
        """Re-create linear weights that vLLM's CPU path freed after packing. Returns how many."""
        from vllm.model_executor.layers import linear as vlinear

        model = self.model_runner.model
        recreated: dict[str, Any] = {}
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, vlinear.LinearBase) or weight is None or weight.numel() != 0:
                continue
            qm = module.quant_method
            loader = (
                module.weight_loader_v2
                if qm.__class__.__name__ in vlinear.WEIGHT_LOADER_V2_SUPPORTED and hasattr(module, "weight_loader_v2")
                else module.weight_loader
            )
            del module.weight
            qm.create_weights(
                layer=module,
                input_size_per_partition=getattr(module, "input_size_per_partition", module.input_size),
                output_partition_sizes=module.output_partition_sizes,
                input_size=module.input_size,
                output_size=module.output_size,
                params_dtype=module.params_dtype,
                weight_loader=loader,
            )
            # model.load_weights reports a LoRA-wrapped layer's weight without ".base_layer"
            recreated[f"{name}.weight".replace(".base_layer.", ".")] = module
        self._meshrl_recreated = recreated
        self._meshrl_loaded: set[str] = set()
        return len(recreated)

    def meshrl_load_weights(self, payload: bytes) -> int:
        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(payload)
        loaded = self.model_runner.model.load_weights(weights=list(tensors.items()))
        if loaded:
            getattr(self, "_meshrl_loaded", set()).update(loaded)
        return len(tensors)

    def meshrl_finish_update(self) -> int:
        recreated: dict[str, Any] = getattr(self, "_meshrl_recreated", {})
        loaded: set[str] = getattr(self, "_meshrl_loaded", set())
        missing = sorted(n for n in recreated if n not in loaded)
        if missing:
            raise RuntimeError(
                f"weight update did not cover {len(missing)} repacked CPU linear weights (e.g. {missing[:3]}); "
                "on CPU every update must carry the full model"
            )
        for module in recreated.values():
            module.quant_method.process_weights_after_loading(module)
        # Layers that keep their weight but matmul through a packed copy made at load time (the
        # CPU path of the LM head) must be repacked too, or they compute with the old weights.
        repacked = 0
        for module in self.model_runner.model.modules():
            if module in recreated.values() or not hasattr(module, "cpu_linear"):
                continue
            qm = getattr(module, "quant_method", None)
            weight = getattr(module, "weight", None)
            if qm is not None and weight is not None and weight.numel() > 0:
                qm.process_weights_after_loading(module)
                repacked += 1
        self._meshrl_recreated = {}
        return len(recreated) + repacked

    def meshrl_patch_sampler(self) -> bool:
        sampler = self.model_runner.sampler
        tks = sampler.topk_topp_sampler
        if getattr(tks, "_meshrl_patched", False):
            return True
        if tks.logprobs_mode != "processed_logprobs":
            return False
        inner = tks.forward

        def forward(logits: torch.Tensor, generators: Any, k: torch.Tensor | None, p: torch.Tensor | None) -> Any:
            # The inner sampler may truncate `logits` in place: take the full distribution first.
            full = logits.log_softmax(dim=-1, dtype=torch.float32) if (k is not None or p is not None) else None
            sampled, processed = inner(logits, generators, k, p)
            if full is not None and processed is not None:
                processed = full
            return sampled, processed

        tks.forward = forward
        tks._meshrl_patched = True
        return True
