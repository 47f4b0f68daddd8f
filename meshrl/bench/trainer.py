"""`meshrl bench trainer`: training tokens/s of the FSDP engine (one rank) against a plain PyTorch
loop on the same model, batch and optimizer (the in-run baseline).

Cases, interleaved step by step so that background load hits all of them alike:
- `plain`: a Hugging Face causal LM, the right-padded batch with its attention mask, masked
  token-mean NLL, clip_grad_norm_, AdamW (baseline);
- `fsdp_padded`: the `fsdp` engine, same padded rows (use_remove_padding=false);
- `fsdp_packed`: the `fsdp` engine, sequences packed into one varlen row (use_remove_padding=true).
Every case starts from the same weights and trains on the same batch; the first step's loss of each
engine case is checked against the baseline's. Tokens are real (non-padding) tokens. `vs_plain`
compares median wall-clock step times; `vs_plain_cpu` median CPU time of this process per step,
which other work on a shared machine disturbs far less (one torch thread by default, so that
OpenMP spin-waiting does not count as work).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from services.common.config.actor_rollout_ref import ActorConfig, ModelConfig, OptimConfig
from services.common.tiny import build_tiny_model, build_tokenizer
from services.trainer.engines.base import EngineSpec, ForwardOutput, LossScale, SequenceBatch, get_engine_cls


def make_batch(batch_size: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> SequenceBatch:
    """Right-padded sequences of lengths spread over [min_len, max_len]; the second half of each
    sequence is the response."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_len, max_len, batch_size).round().long()
    ids = torch.randint(6, vocab, (batch_size, max_len), generator=g)
    pos = torch.arange(max_len)[None]
    attn = (pos < lengths[:, None]).long()
    resp = ((pos >= (lengths // 2)[:, None]) & (attn == 1)).float()
    return SequenceBatch(ids * attn, attn, resp)


def nll(out: ForwardOutput, mb: SequenceBatch, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
    loss = -(out.logprobs * mb.response_mask).sum() / scale.num_tokens * scale.dp_size
    return loss, {"loss": float(loss.item())}


def _plain_step(model: Any, opt: torch.optim.Optimizer, batch: SequenceBatch, grad_clip: float) -> float:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    lp = torch.log_softmax(logits.float()[:, :-1], dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.response_mask[:, 1:]
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def run_benchmark(
    *, steps: int = 12, warmup: int = 2, batch_size: int = 16, min_len: int = 64, max_len: int = 256,
    arch: str = "qwen3", threads: int | None = 1,
) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    tok = build_tokenizer()

    def init() -> Any:
        return build_tiny_model(arch, tok, seed=0)

    batch = make_batch(batch_size, min_len, max_len, len(tok))
    tokens = int(batch.attention_mask.sum().item())
    optim = OptimConfig(lr=1e-4)
    actor = ActorConfig(optim=optim, grad_clip=1.0)

    plain = init()
    plain.train()
    opt = torch.optim.AdamW(plain.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)
    engines = {
        name: get_engine_cls("fsdp", "cpu").build(EngineSpec(
            model=ModelConfig(use_remove_padding=packed), actor=actor, device="cpu",
            total_training_steps=steps + warmup, model_init=init,
        ))
        for name, packed in (("fsdp_padded", False), ("fsdp_packed", True))
    }
    def engine_step(engine: Any) -> Callable[[], float]:
        return lambda: engine.train_step([batch], nll).metrics["loss"]

    cases: dict[str, Callable[[], float]] = {"plain": lambda: _plain_step(plain, opt, batch, actor.grad_clip)}
    cases.update({name: engine_step(e) for name, e in engines.items()})
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    first_loss: dict[str, float] = {}
    names = list(cases)
    for i in range(warmup + steps):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            t, c = time.perf_counter(), time.process_time()
            loss = cases[name]()
            dt, dc = time.perf_counter() - t, time.process_time() - c
            first_loss.setdefault(name, loss)
            if i >= warmup:
                wall[name].append(dt)
                cpu[name].append(dc)
    base = tokens / statistics.median(wall["plain"])
    base_cpu = tokens / statistics.median(cpu["plain"])
    results = {}
    for name in cases:
        tps = tokens / statistics.median(wall[name])
        tpc = tokens / statistics.median(cpu[name])
        results[name] = {
            "tokens_per_s": round(tps, 1),
            "vs_plain": round(tps / base, 3),
            "tokens_per_cpu_s": round(tpc, 1),
            "vs_plain_cpu": round(tpc / base_cpu, 3),
            "step_s_median": round(statistics.median(wall[name]), 4),
            "step_s_min": round(min(wall[name]), 4),
            "first_loss": round(first_loss[name], 6),
            "first_loss_diff_vs_plain": abs(first_loss[name] - first_loss["plain"]),
        }
    params = sum(p.numel() for p in plain.parameters())
    return {
        "benchmark": "trainer",
        "setup": {
            "arch": arch, "params": params, "batch_size": batch_size, "lengths": [min_len, max_len],
            "real_tokens_per_step": tokens, "padded_tokens_per_step": batch_size * max_len,
            "steps": steps, "warmup": warmup, "threads": torch.get_num_threads(), "torch": torch.__version__,
        },
        "baseline": "plain",
        "results": results,
    }
