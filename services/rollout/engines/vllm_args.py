"""vLLM engine arguments from meshrl's config (importable without vLLM, so it is unit-tested)."""

from __future__ import annotations

from typing import Any

EXTENSION = "services.rollout.engines.vllm_ext.MeshrlWorkerExtension"
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_args_from_config(
    model_path: str,
    rollout: Any,
    *,
    max_model_len: int | None = None,
    seed: int | None = None,
    device: str | None = None,
    lora_rank: int = 0,
    node_devices: int | None = None,
) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments from actor_rollout_ref.rollout (RolloutEngineConfig);
    `device` is the device kind the replica runs on (cuda, npu or cpu; None: unknown, and sleep
    mode stays off); `lora_rank` (actor_rollout_ref.model.lora_rank) > 0 turns on vLLM's LoRA
    support; `node_devices` (rollout.n_gpus_per_node; None: unknown) decides whether the engine
    spans nodes."""
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=rollout.dtype,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        max_num_seqs=rollout.max_num_seqs,
        max_num_batched_tokens=rollout.max_num_batched_tokens,
        enable_chunked_prefill=rollout.enable_chunked_prefill,
        enable_prefix_caching=rollout.enable_prefix_caching,
        enforce_eager=rollout.enforce_eager,
        tensor_parallel_size=rollout.tensor_model_parallel_size,
        data_parallel_size=rollout.data_parallel_size,
        enable_expert_parallel=rollout.expert_parallel_size > 1,
        max_model_len=max_model_len or rollout.max_model_len,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=EXTENSION,
        # Sleep mode frees the KV cache during weight updates (free_cache_engine); vLLM supports it
        # on CUDA/ROCm (and vllm-ascend), on CPU it is a no-op.
        enable_sleep_mode=bool(rollout.free_cache_engine) and device not in (None, "cpu"),
    )
    if lora_rank > 0:
        # One adapter at a time: every version replaces it (vllm_engine.py); vLLM sizes its LoRA
        # buffers by max_lora_rank, which must be one of its supported ranks.
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=next((r for r in _VLLM_LORA_RANKS if r >= lora_rank), lora_rank))
    if seed is not None:
        kwargs["seed"] = seed
    kwargs.update(rollout.engine_kwargs.get("vllm", {}))
    sizes = {part: n for part, (_, n) in rollout.vllm_parallel().items()}  # engine_kwargs.vllm's win, as above
    dp = sizes["dp"]
    if node_devices is not None and sizes["tp"] * dp * sizes["pp"] > node_devices:
        # An engine larger than a node runs in a Serve replica that reserves no device
        # (meshrl.plan_layout.rollout_engine_spans_nodes): only vLLM's Ray executor places its
        # workers on other nodes, and only Ray data parallel its DP ranks. Left to vLLM, it picks
        # its multiprocessing executor and DP off a Ray placement group, which start every worker
        # on the replica's node (on CUDA it refuses: more workers than the node's devices). A
        # backend set in engine_kwargs.vllm is the user's and stays.
        kwargs.setdefault("distributed_executor_backend", "ray")
        if dp > 1:
            kwargs.setdefault("data_parallel_backend", "ray")
    return {k: v for k, v in kwargs.items() if v is not None}
