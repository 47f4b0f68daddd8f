"""An empty data-parallel share under the interleaved (VPP) schedule: compute_logprobs runs one
dummy per micro-batch slot the schedule needs, so the last pipeline stage holds several outputs
while the other stages hold none; no stage may then broadcast per-sequence results (the sizes
would disagree: gloo aborts, NCCL hangs). Two gloo processes run the real
MegatronEngine.compute_logprobs; only megatron's schedule is stood in for (it calls the loss
function once per micro-batch on the last stage, as megatron's does)."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, out_dir: str) -> None:
    from services.trainer.engines.base import ForwardOutput
    from services.trainer.engines.batching import dummy_batch
    from services.trainer.engines.megatron.engine import MegatronEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    eng = object.__new__(MegatronEngine)
    eng.model = [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)]  # two model chunks per stage: VPP 2
    eng.ref_model = None
    eng.coords = types.SimpleNamespace(pp_size=2)
    eng.groups = types.SimpleNamespace(pp=dist.group.WORLD)
    eng.tcfg = types.SimpleNamespace(microbatch_group_size_per_vp_stage=None)
    eng.cfg = types.SimpleNamespace(log_prob_micro_batch_size=None)
    eng.device = "cpu"
    eng._onload = lambda *a: None
    eng._offload_model = lambda *a: None
    eng._token_logprobs = lambda out, mb, t, e: ForwardOutput(
        torch.zeros(mb.input_ids.shape), torch.zeros(mb.input_ids.shape) if e else None)

    def schedule(model: object, micro: list, loss_func: object, forward_only: bool) -> None:
        if rank == 1:  # the last stage
            for mb in micro:
                loss_func(mb, torch.zeros(1))  # type: ignore[operator]

    eng._run_schedule = schedule
    out = eng.compute_logprobs(dummy_batch(8, 0).select([]), with_entropy=True)
    assert out.entropy is not None
    Path(out_dir, f"rank{rank}").write_text(f"{tuple(out.logprobs.shape)} {tuple(out.entropy.shape)}")
    dist.destroy_process_group()


def test_empty_dp_share_under_vpp_keeps_every_stage_in_step(tmp_path: Path) -> None:
    from services.common.serve_util import free_port

    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["(0, 8) (0, 8)"] * 2
