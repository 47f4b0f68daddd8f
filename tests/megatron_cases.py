"""Shared by the CPU tests (tests/unit/test_megatron_engine.py) and the GPU tests
(tests/gpu/test_megatron_gpu.py): build a tiny HF checkpoint, run tests/megatron_worker.py under
torchrun, read its JSON, and check it against stated tolerances."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "megatron_worker.py"


def tiny_checkpoint(arch: str, path: Path, **overrides: object) -> Path:
    from services.common.tiny import build_tiny_model, build_tokenizer, save_pretrained_pair

    if not (path / "config.json").exists():
        tok = build_tokenizer()
        save_pretrained_pair(build_tiny_model(arch, tok, seed=0, **overrides), tok, path)
    return path


def run_worker(ckpt: Path, out: Path, nproc: int, *args: str, timeout_s: int = 600, worker: Path = WORKER) -> dict[str, Any]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MESHRL_LOG_FORMAT": "console"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        str(worker), "--ckpt", str(ckpt), "--out", str(out), *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"worker failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    return dict(json.loads(out.read_text()))


# Tolerances (fp32 on both sides; the only differences are summation order).
LOGPROB_ATOL = 1e-4
GRAD_NORM_RTOL = 1e-4
POST_TRAIN_LOGPROB_ATOL = 1e-3
RESUME_ATOL = 1e-6


def check_equivalence(r: dict[str, Any], *, n_micro: int, logprob_atol: float = LOGPROB_ATOL,
                      grad_rtol: float = GRAD_NORM_RTOL, post_atol: float = POST_TRAIN_LOGPROB_ATOL) -> None:
    assert r["hf_roundtrip_exact"], "HF -> megatron -> HF was not bit-exact"
    assert r["export_names_match"], "exported names differ from the checkpoint's"
    # param_server.collective_sharded: the ranks' own slices are the export, each byte from one rank
    assert r["shards_rebuild_export"], "the ranks' own slices do not rebuild the export"
    assert sum(r["shard_bytes_per_rank"]) == r["export_bytes"], (r["shard_bytes_per_rank"], r["export_bytes"])
    assert r["logprob_max_abs_diff"] <= logprob_atol, r["logprob_max_abs_diff"]
    assert r["entropy_max_abs_diff"] <= logprob_atol, r["entropy_max_abs_diff"]
    for got, ref in zip(r["grad_norms"], r["ref_grad_norms"], strict=True):
        assert abs(got - ref) <= grad_rtol * abs(ref), (r["grad_norms"], r["ref_grad_norms"])
    # The engine averages metrics over the micro-batches it ran; the reference sums their losses.
    assert all(u == 1.0 for u in r["unit_metric"]), r["unit_metric"]
    for got, ref in zip(r["losses"], r["ref_losses"], strict=True):
        assert abs(got * n_micro - ref) <= max(logprob_atol, grad_rtol * abs(ref)) * 10, (r["losses"], r["ref_losses"])
    assert r["post_train_logprob_max_abs_diff"] <= post_atol, r["post_train_logprob_max_abs_diff"]
    assert r["steps"] == list(range(1, len(r["steps"]) + 1))
