"""Process-group and model-parallel setup for the megatron engine, and the two patches that let
megatron-core 0.16 run forward/backward on CPU (tests only; megatron's optimizer stays GPU/NPU).

Who calls what, in order, on every rank:

    import_megatron()                      # fails with "install meshrl[megatron]" if absent
    init_distributed(device)               # torch.distributed from torchrun / Ray env vars
    [mindspeed: repatch(...)]              # before model-parallel init (see engines/mindspeed)
    init_model_parallel(megatron_cfg)      # parallel_state + RNG trackers
    ... build model, train ...
    destroy_model_parallel()
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from services.common.config.actor_rollout_ref import MegatronConfig
from services.common.device import apply_collective_env, collective_backend
from services.common.errors import ConfigError, MissingDependency

from .convert import ParallelCoords, ParallelGroups
from .shards import Replicas

_CPU_PATCHED = False


def import_megatron() -> ModuleType:
    """megatron.core, or MissingDependency naming the extra (and the Python floor of 0.17+).
    megatron-core warns at import, per module, that Apex / Transformer Engine are absent; meshrl
    runs the local spec without them on purpose, so those warnings are silenced (the engine
    logs once whether TE is in use)."""
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*(not installed|Falling back).*")
    warnings.filterwarnings("ignore", message=r".*custom_layers.transformer_engine.*deprecated.*")
    try:
        import megatron.core as mcore
    except ImportError as exc:
        raise MissingDependency(
            "megatron-core",
            "`pip install meshrl[megatron]` (megatron-core 0.16.1 on Python 3.11; 0.17+ needs Python 3.12); "
            f"import failed with: {exc}",
        ) from exc
    return mcore


def apply_compat_patches() -> None:
    """megatron-core 0.16.1 without Transformer Engine: `moe_utils.te_general_gemm` is referenced
    by the router's gating linear but only defined when TE imports (NameError on every MoE
    forward). Define it as None so the plain torch path runs."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def apply_cpu_patches() -> None:
    """megatron-core 0.16 allocates with `torch.cuda.current_device()` and forks CUDA RNG states
    in its layers; on a CPU-only torch both fail. Point the device at "cpu" and make RNG forks
    no-ops (dropout is 0 in RL training, and model init is replaced by the HF weights)."""
    global _CPU_PATCHED
    if _CPU_PATCHED or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # type: ignore[method-assign,assignment,misc]
    # The pipeline schedules allocate one counter with device="cuda" and p2p syncs the CUDA
    # stream; on CPU the counter goes to the CPU and the sync is a no-op (gloo is synchronous).
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CpuTorch(torch)  # type: ignore[attr-defined]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    _CPU_PATCHED = True


class _CpuTorch:
    """`torch` as megatron's schedules module sees it on CPU: device="cuda" becomes "cpu"."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def zeros(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return self._real.zeros(*args, **kwargs)


def init_distributed(device: str, timeout_s: int = 600) -> tuple[int, int]:
    """Initialise torch.distributed from the usual env vars (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT; LOCAL_RANK picks the device) unless already done. Returns (rank, world_size)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        backend = collective_backend(device)
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        elif device == "npu":
            torch.npu.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # type: ignore[attr-defined]
        apply_collective_env(backend)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_layout(m: MegatronConfig, world_size: int, num_experts: int = 0) -> int:
    """Data-parallel size of `m` on `world_size` ranks, or ConfigError naming the fix."""
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"actor_rollout_ref.actor.megatron: TP({tp}) x PP({pp}) x CP({cp}) = {tp * pp * cp} does not divide the "
            f"{world_size} training devices; change the parallel sizes or trainer.nnodes x trainer.n_gpus_per_node"
        )
    etp = m.expert_tensor_parallel_size or tp
    ep = m.expert_model_parallel_size
    if (world_size // pp) % (etp * ep):
        raise ConfigError(
            f"actor_rollout_ref.actor.megatron: ETP({etp}) x EP({ep}) = {etp * ep} does not divide the {world_size // pp} "
            f"devices of one pipeline stage; change expert_model_parallel_size or expert_tensor_parallel_size"
        )
    if num_experts and etp > tp:
        # With megatron-core 0.16.1 an ETP above TP trains wrong expert gradients on CPU/gloo (the
        # forward is exact); unchecked on GPU, so refused rather than trained wrong.
        raise ConfigError(
            f"actor_rollout_ref.actor.megatron.expert_tensor_parallel_size={etp} is above "
            f"tensor_model_parallel_size={tp}: its expert gradients were found wrong; use an ETP of at most {tp}"
        )
    if num_experts and num_experts % ep:
        raise ConfigError(
            f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep} does not divide the model's {num_experts} "
            f"experts; pick a divisor of {num_experts}"
        )
    if m.virtual_pipeline_model_parallel_size and pp == 1:
        raise ConfigError(
            "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1; "
            "set it to null"
        )
    return world_size // (tp * pp * cp)


def init_model_parallel(m: MegatronConfig, device: str, seed: int) -> None:
    """parallel_state for `m` (idempotent for the same layout) and megatron's RNG trackers."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    apply_compat_patches()
    if device == "cpu":
        apply_cpu_patches()
    check_layout(m, dist.get_world_size())
    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == m.tensor_model_parallel_size
            and ps.get_pipeline_model_parallel_world_size() == m.pipeline_model_parallel_size
            and ps.get_context_parallel_world_size() == m.context_parallel_size
            and ps.get_expert_model_parallel_world_size() == m.expert_model_parallel_size
        )
        if not same:
            raise ConfigError("actor and ref megatron layouts must be the same in one process; copy the actor's sizes to ref.megatron")
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
        context_parallel_size=m.context_parallel_size,
        expert_model_parallel_size=m.expert_model_parallel_size,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size,
        create_gloo_process_groups=device != "cpu",
    )
    torch.manual_seed(seed)
    if device in ("cuda", "npu"):  # on NPU MindSpeed routes megatron's CUDA RNG calls to the NPU
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def coords() -> ParallelCoords:
    """This rank's ParallelCoords (for weight sharding)."""
    from megatron.core import parallel_state as ps

    return ParallelCoords(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
    )


def groups() -> ParallelGroups:
    """This rank's ParallelGroups (for weight gathers and pipeline broadcasts)."""
    from megatron.core import parallel_state as ps

    return ParallelGroups(
        tp=ps.get_tensor_model_parallel_group(),
        ep=ps.get_expert_model_parallel_group(),
        etp=ps.get_expert_tensor_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
    )


def replicas() -> Replicas:
    """This rank's place among its parameters' copies (which rank sends them in the weight sync
    from every rank): its data-parallel rank with context parallelism, and its expert-data-parallel
    rank."""
    from megatron.core import parallel_state as ps

    return Replicas(dense=ps.get_data_parallel_rank(with_context_parallel=True), expert=ps.get_expert_data_parallel_rank())
