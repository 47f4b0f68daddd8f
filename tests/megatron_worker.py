"""One rank of a megatron-engine equivalence check, run under torchrun by the tests (CPU, gloo)
and by scripts/gpu/megatron.sh (GPU, nccl). Compares against plain transformers forward /
backward / AdamW on the same HF weights, on rank 0, with the full batch.

    torchrun --nproc-per-node 2 tests/megatron_worker.py --ckpt DIR --out OUT.json \
        --device cpu --tp 2 [--ep 2] [--pp 1] [--steps 3]

Writes {"logprob_max_abs_diff", "entropy_max_abs_diff", "losses", "ref_losses", "grad_norms",
"ref_grad_norms", "export_exact", "post_train_logprob_max_abs_diff", ...} from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from services.common.config.actor_rollout_ref import MegatronConfig, OptimConfig  # noqa: E402
from services.trainer.engines.base import ForwardOutput, LossScale, SequenceBatch  # noqa: E402


def make_batch(vocab: int, seed: int, b: int = 8, length: int = 23) -> SequenceBatch:
    """Odd length on purpose: sequence parallelism must pad it to a multiple of TP."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, vocab, (b, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (b,), generator=g)
    am = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = ids * am
    prompt = 6
    rm = ((torch.arange(length)[None, :] >= prompt).long() * am).float()
    adv = torch.randn(b, length, generator=g) * rm
    return SequenceBatch(ids, am, rm, tensors={"advantages": adv})


def trim(mb: SequenceBatch) -> SequenceBatch:
    """The micro-batch cut to its longest sequence (right padding only, so nothing changes for HF)."""
    n = int(mb.attention_mask.sum(1).max())
    return SequenceBatch(mb.input_ids[:, :n], mb.attention_mask[:, :n], mb.response_mask[:, :n],
                         tensors={k: v[:, :n] for k, v in mb.tensors.items()}, seq_tensors=dict(mb.seq_tensors))


def loss_fn(fo: ForwardOutput, mb: SequenceBatch, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
    """A token-mean policy-gradient-like loss with an entropy term (exercises both outputs)."""
    mask = mb.response_mask.to(fo.logprobs.device)
    adv = mb.tensors["advantages"].to(fo.logprobs.device)
    assert fo.entropy is not None
    per_tok = -(fo.logprobs * adv) - 0.01 * fo.entropy
    loss = (per_tok * mask).sum() / scale.num_tokens * scale.dp_size
    # "unit" is 1 in every micro-batch: the engine's mean over the micro-batches it ran must be 1.
    return loss, {"pg_loss": float(loss.detach()) / scale.dp_size, "unit": 1.0}


def hf_reference(ckpt: str, batch: SequenceBatch, micro: int, steps: int, optim: OptimConfig, clip: float, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)

    def logprobs(ids: torch.Tensor, am: torch.Tensor, rm: torch.Tensor, grad: bool):
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=ids.to(device), attention_mask=am.to(device)).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1)
            lp = logp.gather(-1, ids[:, 1:, None].to(device)).squeeze(-1)
            ent = -(logp.exp() * logp).sum(-1)
            z = torch.zeros(ids.shape[0], 1, device=device)
            r = rm.to(device)
            return torch.cat([z, lp], 1) * r, torch.cat([z, ent], 1) * r

    lp0, ent0 = logprobs(batch.input_ids, batch.attention_mask, batch.response_mask, False)
    losses, norms = [], []
    n_tok = batch.num_response_tokens
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for i in range(0, batch.num_seqs, micro):
            mb = batch.select(list(range(i, min(i + micro, batch.num_seqs))))
            lp, ent = logprobs(mb.input_ids, mb.attention_mask, mb.response_mask, True)
            scale = LossScale(num_tokens=n_tok, num_seqs=batch.num_seqs, dp_size=1)
            loss, _ = loss_fn(ForwardOutput(lp, ent), mb.to(device), scale)
            loss.backward()
            total += float(loss)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(total)
    lp_after, _ = logprobs(batch.input_ids, batch.attention_mask, batch.response_mask, False)
    return lp0.cpu(), ent0.cpu(), losses, norms, lp_after.cpu(), model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--dist-opt", action="store_true")
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--first-stage-layers", type=int, default=None)
    ap.add_argument("--last-stage-layers", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--override-transformer", default="{}", help="JSON for override_transformer_config")
    ap.add_argument("--override-optimizer", default="{}", help="JSON for override_optimizer_config")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--ragged", action="store_true",
                    help="cut each micro-batch to its longest sequence (micro-batches then differ in length)")
    ap.add_argument("--save-dir", default=None, help="also test save_checkpoint/load_checkpoint and save_hf here")
    ap.add_argument("--mesh-config", default=None, help="build the engine from this meshrl config (a recipe miniature)")
    ap.add_argument("--set", action="append", default=[], help="dotted override for --mesh-config")
    ap.add_argument("--build-spec", action="store_true",
                    help="construct through TrainEngine.build(spec) with model.path=null and a model_init callable")
    ap.add_argument("--proximal", action="store_true", help="snapshot_proximal before training, compare after")
    ap.add_argument("--uneven-dp", action="store_true",
                    help="DP rank 0 trains on every sequence, the others on an empty share")
    ap.add_argument("--all-rejected", action="store_true",
                    help="after the rest, one step whose every response token is masked out (skipped, weights kept)")
    ap.add_argument("--nonfinite", action="store_true",
                    help="after the rest, one step whose loss is NaN (skipped, weights kept), then a normal one")
    args = ap.parse_args()

    from services.trainer.engines.megatron.config import MegatronEngineConfig
    from services.trainer.engines.megatron.engine import MegatronEngine

    optim = OptimConfig(lr=1e-3, weight_decay=0.01)
    mcfg = MegatronConfig(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp, sequence_parallel=args.sp, use_distributed_optimizer=args.dist_opt,
        virtual_pipeline_model_parallel_size=args.vpp,
        override_transformer_config={
            **{k: v for k, v in (
                ("num_layers_in_first_pipeline_stage", args.first_stage_layers),
                ("num_layers_in_last_pipeline_stage", args.last_stage_layers),
            ) if v is not None},
            **json.loads(args.override_transformer),
        },
        override_optimizer_config=json.loads(args.override_optimizer),
    )
    ecfg = MegatronEngineConfig(
        model_path=args.ckpt, device=args.device, dtype=args.dtype, megatron=mcfg, optim=optim, grad_clip=1.0,
        total_training_steps=args.steps,
    )
    if args.mesh_config:
        from services.common.config import derive, load_config

        cfg = load_config(args.mesh_config, [f"actor_rollout_ref.model.path={args.ckpt}", *args.set])
        ecfg = MegatronEngineConfig.from_mesh(cfg, args.device, derive(cfg).total_local_steps)
        ecfg = ecfg.model_copy(update={"dtype": args.dtype})
        mcfg, optim = ecfg.megatron, ecfg.optim
    if args.build_spec:
        from types import SimpleNamespace

        from transformers import AutoModelForCausalLM

        from services.common.config.actor_rollout_ref import ActorConfig, ModelConfig

        spec = SimpleNamespace(  # the fields of main's EngineSpec
            model=ModelConfig(path=None, dtype=args.dtype),
            actor=ActorConfig(strategy="megatron", megatron=mcfg, optim=optim, grad_clip=1.0),
            ref=None, device=args.device, total_training_steps=args.steps, log_prob_micro_batch_size_per_gpu=None,
            seed=42, collective_timeout_s=600.0,
            model_init=lambda: AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32),
        )
        engine = MegatronEngine.build(spec)
        assert engine.model_path != args.ckpt
    else:
        engine = MegatronEngine(ecfg)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.ckpt).vocab_size
    batch = make_batch(vocab, seed=0)
    rank = engine.rank

    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    initial: dict[str, torch.Tensor] = {}
    for bucket in engine.export_weights(bucket_bytes=64 * 1024):
        initial.update(dict(bucket))
    out = engine.compute_logprobs(batch, with_entropy=True)
    if args.proximal:
        engine.snapshot_proximal()
    per = batch.num_seqs // dp
    shard = batch.select(list(range(dp_rank * per, (dp_rank + 1) * per)))
    empty_shapes: list = [None] * engine.world_size
    if args.uneven_dp:  # as a batch with fewer sequences than DP ranks leaves some ranks
        shard = batch if dp_rank == 0 else batch.select([])
        per = shard.num_seqs
        mine = engine.compute_logprobs(shard, with_entropy=True)
        import torch.distributed as dist

        shapes = [list(mine.logprobs.shape), list(mine.entropy.shape) if mine.entropy is not None else None]
        dist.all_gather_object(empty_shapes, shapes)
    micro = [shard.select(list(range(i, min(i + args.micro, per)))) for i in range(0, per, args.micro)]
    if args.ragged:
        micro = [trim(mb) for mb in micro]
    results = [engine.train_step(micro, loss_fn) for _ in range(args.steps)]
    after = engine.compute_logprobs(batch)
    proximal = engine.compute_proximal_logprobs(batch) if args.proximal else None
    after_again = engine.compute_logprobs(batch) if args.proximal else None
    ref_after = engine.compute_logprobs(batch, reference=True) if ecfg.ref_megatron is not None else None
    exported: dict[str, torch.Tensor] = {}
    for bucket in engine.export_weights(bucket_bytes=64 * 1024):
        exported.update(dict(bucket))

    # param_server.collective_sharded: each rank's own slices (no collective), gathered here only
    # to check that together they are the export, element for element, each sent once.
    import torch.distributed as dist

    from services.weights.shards import ShardAssembler

    own = [(n, t.cpu()) for bucket in engine.export_shards(bucket_bytes=64 * 1024) for n, t in bucket]
    every_rank: list = [None] * engine.world_size
    dist.all_gather_object(every_rank, own)
    shards_report: dict[str, object] = {}
    if engine.rank == 0:
        asm = ShardAssembler("cpu")
        rebuilt = {n: t for part in every_rank for wire, piece in part for n, t in asm.add(wire, piece)}
        shards_report = {
            "shards_rebuild_export": asm.finish() == sorted(exported)
            and all(rebuilt[k].dtype == exported[k].dtype and torch.equal(rebuilt[k], exported[k]) for k in exported),
            "shard_bytes_per_rank": [sum(t.numel() * t.element_size() for _, t in part) for part in every_rank],
            "export_bytes": sum(t.numel() * t.element_size() for t in exported.values()),
        }

    from services.trainer.engines.megatron.weights import unwrap

    report: dict[str, object] = {
        "dp": [engine.dp_rank, engine.dp_size],
        "share_logprob_shapes": empty_shapes,
        "applied_transformer": {
            k: repr(getattr(unwrap(engine.model[0]).config, k)) for k in mcfg.override_transformer_config
        },
        "applied_optimizer": {k: repr(getattr(engine.optimizer_config, k)) for k in mcfg.override_optimizer_config},
        "export_equals_initial": all(torch.equal(exported[k], initial[k]) for k in initial) if engine.rank == 0 else None,
        **shards_report,
    }
    if args.all_rejected:  # e.g. the rollout correction rejected every token of the step
        from dataclasses import replace

        rejected = [replace(mb, response_mask=torch.zeros_like(mb.response_mask)) for mb in micro]
        try:
            skipped = engine.train_step(rejected, loss_fn)
            kept = {n: t for bucket in engine.export_weights(bucket_bytes=64 * 1024) for n, t in bucket}
            report["all_rejected"] = {
                # the FSDP engine's num_tokens: the step's non-padding tokens, trained on or not
                "step": skipped.step, "num_tokens_are_the_batchs": skipped.num_tokens == int(batch.attention_mask.sum()),
                "step_skipped": skipped.metrics.get("actor/step_skipped"),
                "weights_kept": all(torch.equal(kept[k], exported[k]) for k in exported) if engine.rank == 0 else None,
            }
        except Exception as exc:  # report it and keep the equivalence numbers
            report["all_rejected"] = {"error": f"{type(exc).__name__}: {exc}"}
    if args.nonfinite:  # e.g. a bf16 overflow: the gradient norm is NaN
        def nan_loss(fo: ForwardOutput, mb: SequenceBatch, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
            loss, metrics = loss_fn(fo, mb, scale)
            return loss * float("nan"), metrics

        try:
            before = results[-1].metrics
            bad = engine.train_step(micro, nan_loss)
            kept = {n: t for bucket in engine.export_weights(bucket_bytes=64 * 1024) for n, t in bucket}
            good = engine.train_step(micro, loss_fn)
            report["nonfinite"] = {
                "normal_step_skipped": before.get("actor/step_skipped"),
                "normal_grad_norm_nonfinite": before.get("actor/grad_norm_nonfinite"),
                "step": bad.step, "grad_norm_finite": bool(torch.isfinite(torch.tensor(bad.grad_norm))),
                "step_skipped": bad.metrics.get("actor/step_skipped"),
                "grad_norm_nonfinite": bad.metrics.get("actor/grad_norm_nonfinite"),
                "weights_kept": all(torch.equal(kept[k], exported[k]) for k in exported) if engine.rank == 0 else None,
                "next_step_skipped": good.metrics.get("actor/step_skipped"),
                "next_grad_norm_finite": bool(torch.isfinite(torch.tensor(good.grad_norm))),
            }
        except Exception as exc:  # report it and keep the equivalence numbers
            report["nonfinite"] = {"error": f"{type(exc).__name__}: {exc}"}
    if args.save_dir:
        try:
            engine.save_hf(Path(args.save_dir) / "hf")
            engine.save_checkpoint(Path(args.save_dir) / "ckpt")
            more = engine.train_step(micro, loss_fn)
            engine.load_checkpoint(Path(args.save_dir) / "ckpt")
            again = engine.train_step(micro, loss_fn)
            report["resume_loss_diff"] = abs(more.metrics["pg_loss"] - again.metrics["pg_loss"])
            report["resume_grad_norm_diff"] = abs(more.grad_norm - again.grad_norm)
            report["resume_step"] = again.step
        except Exception as exc:  # report it and keep the equivalence numbers
            import traceback

            report["resume_error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"

    if rank == 0:
        from safetensors.torch import load_file

        lp0, ent0, ref_losses, ref_norms, lp_after, ref_model = hf_reference(
            args.ckpt, batch, args.micro, args.steps, optim, ecfg.grad_clip, args.device
        )
        if proximal is not None and after_again is not None:
            report["proximal_logprob_max_abs_diff"] = float((proximal.logprobs - out.logprobs).abs().max())
            report["restored_after_proximal"] = bool(torch.equal(after_again.logprobs, after.logprobs))
        if ref_after is not None:
            report["ref_logprob_max_abs_diff"] = float((ref_after.logprobs - lp0).abs().max())
        original = load_file(str(Path(args.ckpt) / "model.safetensors"))
        from services.trainer.engines.megatron.convert import fused_to_checkpoint_names

        trained = fused_to_checkpoint_names({k: v.detach().cpu() for k, v in ref_model.state_dict().items()})
        if "lm_head.weight" not in original:
            trained.pop("lm_head.weight", None)
        report.update(
            hf_roundtrip_exact=sorted(initial) == sorted(original)
            and all(torch.equal(initial[k], original[k].to(initial[k].dtype)) for k in original),
            logprob_max_abs_diff=float((out.logprobs - lp0).abs().max()),
            entropy_max_abs_diff=float((out.entropy - ent0).abs().max()),  # type: ignore[operator]
            losses=[r.metrics["pg_loss"] for r in results],
            unit_metric=[r.metrics["unit"] for r in results],
            ref_losses=ref_losses,
            grad_norms=[r.grad_norm for r in results],
            ref_grad_norms=ref_norms,
            post_train_logprob_max_abs_diff=float((after.logprobs - lp_after).abs().max()),
            export_names_match=sorted(exported) == sorted(original),
            export_weight_max_abs_diff=max(float((exported[k].float() - trained[k]).abs().max()) for k in exported),
            steps=[r.step for r in results],
            lrs=[r.lr for r in results],
            world_size=engine.world_size,
            layout={"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "ep": args.ep, "dp": dp, "dtype": args.dtype},
            memory=engine.memory_stats(),
        )
        if args.save_dir and (Path(args.save_dir) / "hf" / "model.safetensors").exists():
            saved = load_file(str(Path(args.save_dir) / "hf" / "model.safetensors"))
            report["save_hf_exact"] = sorted(saved) == sorted(exported) and all(
                torch.equal(saved[k], exported[k]) for k in saved
            )
        Path(args.out).write_text(json.dumps(report, indent=2))
    engine.shutdown()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MESHRL_LOG_FORMAT", "console")
    main()
