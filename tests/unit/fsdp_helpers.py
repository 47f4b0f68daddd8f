"""Shared pieces of the FSDP engine tests: a fixed batch, a masked-NLL loss, engine specs, and a
multi-rank runner (torch.multiprocessing + gloo on 127.0.0.1) whose ranks run scenarios and
hand back full weights, grad norms and losses."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.common.config.actor_rollout_ref import ActorConfig, ModelConfig, RefConfig
from services.common.tiny import build_tiny_model, build_tokenizer
from services.trainer.engines.base import (
    EngineSpec,
    ForwardOutput,
    LossScale,
    SequenceBatch,
    TrainEngine,
    get_engine_cls,
)
from services.trainer.engines.batching import micro_batches_for, shard_for_dp

# AdamW with betas=(0, 0) and a huge eps makes the update linear in the gradient
# (lr * g / (|g| + eps) ~ lr * g / eps), so weight deltas compare gradients parameter by parameter.
GRAD_PROBE_OPTIM: dict[str, Any] = {"lr": 1.0, "eps": 1e4, "betas": (0.0, 0.0), "weight_decay": 0.0}


SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "head_dim": 16, "intermediate_size": 128}


def tiny_init() -> Any:
    """A 2-layer Qwen3 (keeps the multi-process tests quick on a shared 2-core machine)."""
    return build_tiny_model("qwen3", build_tokenizer(), seed=0, **SMALL)


def fixed_batch(seed: int = 0, num_seqs: int = 4, length: int = 24, prompt: int = 5) -> SequenceBatch:
    """Right-padded sequences of different lengths; responses after `prompt` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 90, (num_seqs, length), generator=g)
    lens = torch.tensor([length - (i * 5) % (length - prompt - 2) for i in range(num_seqs)])
    attn = (torch.arange(length)[None] < lens[:, None]).long()
    ids = ids * attn
    resp = ((torch.arange(length)[None] >= prompt) & (attn == 1)).float()
    return SequenceBatch(ids, attn, resp, seq_tensors={"group_index": torch.arange(num_seqs) // 2})


def nll_loss(out: ForwardOutput, mb: SequenceBatch, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean NLL over the whole mini-batch (the LossScale contract)."""
    nll_sum = -(out.logprobs * mb.response_mask).sum()
    return nll_sum / scale.num_tokens * scale.dp_size, {"nll_sum": float(nll_sum.item())}


def make_spec(
    *,
    remove_padding: bool = True,
    sp: int = 1,
    optim: dict[str, Any] | None = None,
    micro: int | None = None,
    dynamic_bsz: bool = False,
    max_tokens: int = 16384,
    param_offload: bool = False,
    optimizer_offload: bool = False,
    with_ref: bool = False,
    override_config: dict[str, Any] | None = None,
    total_steps: int = 20,
    grad_clip: float = 1.0,
    grad_ckpt: bool = False,
    entropy_coeff: float = 0.0,
    model_init: Callable[[], Any] = tiny_init,
    device: str = "cpu",
    mixed_precision: str = "none",
    model_extra: dict[str, Any] | None = None,
) -> EngineSpec:
    actor = ActorConfig(
        optim=optim or {"lr": 1e-3},
        ppo_micro_batch_size_per_gpu=micro,
        use_dynamic_bsz=dynamic_bsz,
        ppo_max_token_len_per_gpu=max_tokens,
        ulysses_sequence_parallel_size=sp,
        grad_clip=grad_clip,
        entropy_coeff=entropy_coeff,
        fsdp_config={
            "param_offload": param_offload, "optimizer_offload": optimizer_offload, "mixed_precision": mixed_precision,
        },
    )
    model = ModelConfig(
        use_remove_padding=remove_padding, override_config=override_config or {},
        enable_gradient_checkpointing=grad_ckpt, **(model_extra or {}),
    )
    return EngineSpec(
        model=model, actor=actor, device=device, total_training_steps=total_steps,
        ref=RefConfig() if with_ref else None, model_init=model_init,
    )


def build(spec: EngineSpec) -> TrainEngine:
    return get_engine_cls("fsdp", spec.device).build(spec)


def full_weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for bucket in engine.export_weights(1 << 30):
        out.update(bucket)
    return out


def run_scenario(engine: TrainEngine, batch: SequenceBatch, steps: int = 1) -> dict[str, Any]:
    """Logprobs before training, then `steps` train steps on this rank's share of `batch`."""
    shards = shard_for_dp(batch, engine.dp_size)
    mine = batch.select(shards[engine.dp_rank])
    before = engine.compute_logprobs(mine, with_entropy=True)
    w0 = full_weights(engine)
    results = []
    for _ in range(steps):
        r = engine.train_step(micro_batches_for(engine.spec.actor, mine), nll_loss)  # type: ignore[attr-defined]
        results.append({"grad_norm": r.grad_norm, "lr": r.lr, "num_tokens": r.num_tokens})
    w1 = full_weights(engine)
    own = [(n, t.cpu()) for b in engine.export_shards(1 << 20) for n, t in b]
    return {
        "shards": own,
        "final": w1,
        "index": shards[engine.dp_rank],
        "logprobs": before.logprobs,
        "entropy": before.entropy,
        "steps": results,
        "delta": {k: w1[k] - w0[k] for k in w1},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, scenarios: dict[str, dict[str, Any]], out_dir: str) -> None:
    on_cpu = all(kw.get("device", "cpu") == "cpu" for kw in scenarios.values())
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK="0" if on_cpu else str(rank),
    )
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    try:
        for name, kw in scenarios.items():
            kw = dict(kw)
            steps = kw.pop("steps", 1)
            batch = fixed_batch(num_seqs=kw.pop("num_seqs", 4))
            load = kw.pop("load", None)
            engine = build(make_spec(**kw))
            if load is not None:
                engine.load_checkpoint(Path(load))
            results[name] = run_scenario(engine, batch, steps)
            engine.close()
    except Exception:
        results["error"] = traceback.format_exc()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    import torch.distributed as dist

    if dist.is_initialized() and "error" not in results:
        # leave together: a rank exiting with the group's threads alive can abort the other
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(world: int, scenarios: dict[str, dict[str, Any]], out_dir: Path) -> list[dict[str, Any]]:
    """Run `scenarios` (name -> make_spec kwargs, plus `steps`, `num_seqs` and `load`: a
    checkpoint to resume from) on `world` ranks
    (gloo on CPU; one CUDA device per rank, nccl, when the scenarios say device="cuda")."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(world, free_port(), scenarios, str(out_dir)), nprocs=world, join=True)
    outs = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, o in enumerate(outs):
        assert "error" not in o, f"rank {r} failed:\n{o['error']}"
    return outs
