"""One rank of the megatron-vs-fsdp equivalence check: both engines built through
`get_engine_cls(backend, device).build(EngineSpec)` on the same HF checkpoint in the same
processes, fed the same sequences (each engine's DP share), trained with the same loss.

    torchrun --standalone --nproc-per-node 2 tests/megatron_vs_fsdp_worker.py --ckpt DIR --out OUT.json \
        --device cpu --tp 2 [--ep 2 --etp 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from megatron_worker import loss_fn, make_batch  # noqa: E402

from services.common.config.actor_rollout_ref import ActorConfig, MegatronConfig, ModelConfig, OptimConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    from services.trainer.engines.base import EngineSpec, get_engine_cls  # main's contract
    from services.trainer.engines.megatron.convert import fused_to_checkpoint_names

    optim = OptimConfig(lr=1e-3, weight_decay=0.01)
    model = ModelConfig(path=args.ckpt, dtype="float32")

    def spec(actor: ActorConfig) -> EngineSpec:
        return EngineSpec(model=model, actor=actor, device=args.device, total_training_steps=args.steps, seed=42)

    # The loss uses entropy with coefficient 0.01: fsdp makes entropy differentiable only when
    # actor.entropy_coeff != 0, so say so to both engines.
    fsdp = get_engine_cls("fsdp", args.device).build(spec(ActorConfig(strategy="fsdp", optim=optim, grad_clip=1.0, entropy_coeff=0.01)))
    # The megatron engine is registered for cuda (and npu); its class also runs on CPU, for tests.
    meg = get_engine_cls("megatron", "cuda")
    megatron = meg.build(spec(ActorConfig(strategy="megatron", optim=optim, grad_clip=1.0, entropy_coeff=0.01, megatron=MegatronConfig(
        tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep, expert_tensor_parallel_size=args.etp,
        sequence_parallel=True, use_distributed_optimizer=args.device != "cpu"))))

    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(args.ckpt).vocab_size, seed=0)
    lp = {}
    for name, eng in (("fsdp", fsdp), ("megatron", megatron)):
        lp[name] = eng.compute_logprobs(batch, with_entropy=True)

    def shard(eng, micro_size: int = 2):  # type: ignore[no-untyped-def]
        per = batch.num_seqs // eng.dp_size
        mine = batch.select(list(range(eng.dp_rank * per, (eng.dp_rank + 1) * per)))
        return [mine.select(list(range(i, min(i + micro_size, per)))) for i in range(0, per, micro_size)]

    results = {name: [eng.train_step(shard(eng), loss_fn) for _ in range(args.steps)]
               for name, eng in (("fsdp", fsdp), ("megatron", megatron))}
    after = {name: eng.compute_logprobs(batch) for name, eng in (("fsdp", fsdp), ("megatron", megatron))}
    exported = {}
    for name, eng in (("fsdp", fsdp), ("megatron", megatron)):
        weights: dict[str, torch.Tensor] = {}
        for bucket in eng.export_weights(1 << 20):
            weights.update(dict(bucket))
        exported[name] = fused_to_checkpoint_names(weights)
    if torch.distributed.get_rank() == 0:
        f, m = exported["fsdp"], exported["megatron"]
        report = {
            "logprob_max_abs_diff": float((lp["fsdp"].logprobs - lp["megatron"].logprobs).abs().max()),
            "entropy_max_abs_diff": float((lp["fsdp"].entropy - lp["megatron"].entropy).abs().max()),  # type: ignore[operator]
            "grad_norms": {k: [r.grad_norm for r in v] for k, v in results.items()},
            "losses": {k: [r.metrics["pg_loss"] for r in v] for k, v in results.items()},
            "num_tokens": {k: [r.num_tokens for r in v] for k, v in results.items()},
            "batch_tokens": int(batch.attention_mask.sum()),
            "post_train_logprob_max_abs_diff": float((after["fsdp"].logprobs - after["megatron"].logprobs).abs().max()),
            "export_names_equal": sorted(f) == sorted(m),
            "export_max_abs_diff": max(float((f[k] - m[k]).abs().max()) for k in f if k in m),
            "dp": {"fsdp": fsdp.dp_size, "megatron": megatron.dp_size},
        }
        Path(args.out).write_text(json.dumps(report, indent=2))
    megatron.close()
    fsdp.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
