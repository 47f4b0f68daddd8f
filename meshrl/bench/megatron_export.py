"""`meshrl bench megatron-export`: the megatron engine's two exports of one version, the same model
on the same ranks in one run (torchrun, one process per rank; `--tp N` needs N devices):

  rank0       `export_weights` (the rank-0 path, the baseline): every full HF tensor gathered over
              TP / EP and the pipeline and copied into a new host tensor on global rank 0
  own_slices  `export_shards` (param_server.collective_sharded): each rank's own HF slices,
              copied on its device, no collective (the slowest rank's time)

Rounds alternate the cases' order; each case is timed from a barrier to its last byte on every
rank. The first round warms up and checks that both cases yield the same weights (the slices
assembled with the receiver's ShardAssembler).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = ("rank0", "own_slices")


def run_benchmark(*, tp: int = 1, hidden: int = 2048, layers: int = 24, rounds: int = 5, bucket_mb: int = 512,
                  device: str = "cuda") -> dict[str, Any]:
    """Launch the ranks (torchrun) and return rank 0's report."""
    with tempfile.TemporaryDirectory(prefix="meshrl-megatron-export-") as tmp:
        out = Path(tmp) / "result.json"
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "NCCL_NVLS_ENABLE": "0"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
               "-m", "meshrl.bench.megatron_export", "--worker", "--out", str(out), "--dir", tmp, "--tp", str(tp),
               "--hidden", str(hidden), "--layers", str(layers), "--rounds", str(rounds), "--bucket-mb", str(bucket_mb),
               "--device", device]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"megatron-export ranks failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        return dict(json.loads(out.read_text()))


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from services.common.config.actor_rollout_ref import MegatronConfig, OptimConfig
    from services.common.tiny import build_tiny_model, build_tokenizer, save_pretrained_pair
    from services.trainer.engines.megatron.config import MegatronEngineConfig
    from services.trainer.engines.megatron.engine import MegatronEngine
    from services.weights.shards import ShardAssembler

    ckpt = Path(args.dir) / "model"
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:  # a random Qwen3 of the requested size, written once for every rank
        tok = build_tokenizer()
        model = build_tiny_model("qwen3", tok, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                 num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8,
                                 head_dim=128, tie_word_embeddings=False)
        save_pretrained_pair(model, tok, Path(args.dir) / "staging")
        del model
        os.replace(Path(args.dir) / "staging", ckpt)
    while not (ckpt / "config.json").exists():
        time.sleep(0.5)
    cuda = args.device == "cuda"
    engine = MegatronEngine(MegatronEngineConfig(
        model_path=str(ckpt), device=args.device, dtype="bfloat16",
        megatron=MegatronConfig(tensor_model_parallel_size=args.tp, use_distributed_optimizer=True),
        optim=OptimConfig(lr=1e-6), grad_clip=1.0, total_training_steps=1,
    ))
    bucket = args.bucket_mb << 20

    streams = {"rank0": lambda: engine.export_weights(bucket), "own_slices": lambda: engine.export_shards(bucket)}

    def run(case: str) -> tuple[float, list[tuple[str, Any]]]:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        got = [(name, t) for b in streams[case]() for name, t in b]
        if cuda:
            torch.cuda.synchronize()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=engine.device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's time: the version is out then
        return float(took.item()), got

    times: dict[str, list[float]] = {c: [] for c in CASES}
    sizes: dict[str, int] = {}
    same: bool | None = None
    for r in range(args.rounds + 1):
        order = CASES if r % 2 == 0 else CASES[::-1]
        firsts: dict[str, dict[str, Any]] = {}
        for case in order:
            took, got = run(case)
            n = torch.tensor([sum(t.numel() * t.element_size() for _, t in got)], dtype=torch.float64, device=engine.device)
            dist.all_reduce(n)
            sizes[case] = int(n.item())
            if r == 0:
                if case == "own_slices":
                    parts: list[Any] = [None] * dist.get_world_size()
                    dist.all_gather_object(parts, [(w, t.cpu()) for w, t in got])
                    if rank == 0:
                        asm = ShardAssembler("cpu")
                        firsts[case] = {k: v for part in parts for w, t in part for k, v in asm.add(w, t)}
                        asm.finish()
                elif rank == 0:
                    firsts[case] = {k: t.cpu() for k, t in got}
            else:
                times[case].append(took)
            del got
        if r == 0 and rank == 0:
            ref = firsts["rank0"]
            same = all(sorted(f) == sorted(ref) and all(torch.equal(f[k], ref[k]) for k in ref) for f in firsts.values())
    if rank == 0:
        med = {c: statistics.median(v) for c, v in times.items()}
        result = {
            "benchmark": "megatron_export", "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "tp": args.tp, "hidden": args.hidden, "layers": args.layers, "dtype": "bfloat16",
            "bucket_bytes": bucket, "rounds": args.rounds, "bytes": sizes, "seconds": times, "median_s": med,
            "gb_per_s": {c: sizes[c] / med[c] / 1e9 for c in CASES},
            "own_slices_over_rank0": med["own_slices"] / med["rank0"],
            "all_cases_same_weights": same,
        }
        Path(args.out).write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    _worker(ap.parse_args())


if __name__ == "__main__":
    main()
