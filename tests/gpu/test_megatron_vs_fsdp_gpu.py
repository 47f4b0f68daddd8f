"""The megatron engine against the fsdp engine on CUDA (NCCL, 2 GPUs): the CPU check of
tests/unit/test_megatron_vs_fsdp.py with `--device cuda` (megatron also with its distributed
optimizer). Same HF weights, same sequences, same loss, 3 AdamW steps; megatron TP=2 (+SP; MoE
EP=2 x ETP=1) against fsdp over 2 data-parallel ranks. Run by scripts/gpu/megatron.sh; each case
writes its JSON report to $MESHRL_GPU_OUT.

Tolerances as on CPU (fp32 both sides, no TF32): logprobs / entropy 1e-4 abs, grad norms 1e-4
rel, logprobs after 3 steps 1e-3 abs, exported weights 1e-3 abs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from tests.megatron_cases import ROOT, run_worker, tiny_checkpoint  # noqa: E402
from tests.unit.test_megatron_vs_fsdp import _check  # noqa: E402

OUT = Path(os.environ.get("MESHRL_GPU_OUT", "/tmp/meshrl-gpu"))
WORKER = ROOT / "tests" / "megatron_vs_fsdp_worker.py"
needs2 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@needs2
@pytest.mark.parametrize(("arch", "args"), [("qwen3", ["--tp", "2"]), ("qwen3_moe", ["--tp", "2", "--ep", "2", "--etp", "1"])])
def test_megatron_matches_fsdp_on_cuda(arch: str, args: list[str], tmp_path: Path) -> None:
    ckpt = tiny_checkpoint(arch, tmp_path / arch)
    r = run_worker(ckpt, tmp_path / "r.json", 2, "--device", "cuda", *args, worker=WORKER)
    OUT.mkdir(parents=True, exist_ok=True)
    shutil.copy(tmp_path / "r.json", OUT / f"megatron_vs_fsdp_{arch}.json")
    _check(r)
