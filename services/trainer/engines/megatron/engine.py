"""The `megatron` training engine: megatron-core GPTModel (Qwen3 dense / Qwen3-MoE) with TP, PP
(uneven first/last stages), VPP, CP, EP and ETP, megatron's DDP and distributed optimizer, HF
weights in and out.

One instance per rank. Timeline of a train_step on every rank of the group:

    reload offloaded buffers -> zero grads -> global token/sequence counts (all-reduce over DP)
    -> megatron forward_backward_func (PP schedule; loss_fn on the last stage)
    -> finalize_model_grads (DP all-reduce, SP norms, tied embeddings) -> clip + optimizer step
    -> offload buffers again

Loss scaling: `loss_fn` returns a loss normalised by the global token count (LossScale), meant to
be summed over micro-batches and averaged over DP; megatron's schedule divides by the number of
micro-batches and its DDP averages over DP x CP while multiplying by CP, so the engine multiplies
each micro-batch loss by the micro-batch count. Result: gradients of the mini-batch loss, exactly.

On `device="cpu"` (gloo; CPU runs of `meshrl train` and the tests) megatron's optimizer is
unavailable (CUDA-only); CpuOptimizer (cpu_optimizer.py), a torch AdamW with megatron's grad-norm
and clipping rules, stands in.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.common.device import DeviceInfo, collective_backend, ray_resource, torch_device
from services.common.device import memory_stats as device_memory_stats
from services.common.errors import ConfigError
from services.common.logging import get_logger
from services.common.model_arch import ModelArch, read_hf_config
from services.trainer.engines.base import (
    ForwardOutput,
    LossFn,
    LossScale,
    SequenceBatch,
    StepResult,
    TrainEngine,
    register_engine,
)
from services.trainer.engines.batching import dummy_batch
from services.weights import Bucket
from services.weights.layout import group_by_bytes

from . import runtime
from .config import MegatronEngineConfig
from .convert import ParallelGroups, check_supported, padded_vocab_size
from .cpu_optimizer import CpuOptimizer
from .logprobs import vocab_parallel_logprobs
from .mcore_config import (
    build_dataclass,
    ddp_config_kwargs,
    has_transformer_engine,
    optimizer_config_kwargs,
    transformer_config_kwargs,
)
from .norms import localize_norms
from .schedule import lr_at
from .shards import owned_slices
from .weights import HFCheckpoint, export_hf, load_hf_into, local_params, unwrap

runtime.import_megatron()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

log = get_logger(__name__)


@register_engine("megatron", "cuda", "cpu")
class MegatronEngine(TrainEngine):
    """One rank of a megatron-core training group (see the module docstring)."""

    config_cls: type[MegatronEngineConfig] = MegatronEngineConfig

    @classmethod
    def from_mesh(cls, cfg: Any, device: str, total_training_steps: int) -> MegatronEngine:
        """Build this rank's engine from a MeshConfig (`actor_rollout_ref.*`, `trainer.seed`);
        call on every rank of the training group (torchrun / Ray env vars set)."""
        return cls(cls.config_cls.from_mesh(cfg, device, total_training_steps))

    @classmethod
    def build(cls, spec: Any) -> MegatronEngine:
        """Construct from the trainer's EngineSpec (`get_engine_cls(backend, device).build(spec)`)."""
        return cls(cls.config_cls.from_spec(spec))

    def __init__(self, config: MegatronEngineConfig) -> None:
        self.cfg = config
        self.device_kind = config.device
        self.rank, self.world_size = runtime.init_distributed(config.device, int(config.collective_timeout_s))
        if config.model_path is None:
            config = self.cfg = config.model_copy(update={"model_path": self._materialize_initial_model()})
        assert config.model_path is not None
        self.model_path: str = config.model_path
        self._proximal: list[torch.Tensor] | None = None
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(torch_device(_DeviceRef(config.device), self.local_rank))
        if config.megatron.context_parallel_size > 1:
            raise ConfigError(
                "actor_rollout_ref.actor.megatron.context_parallel_size > 1: the megatron engine does not split "
                "sequences over CP ranks yet; set context_parallel_size=1"
            )
        self._before_model_parallel_init()
        runtime.init_model_parallel(config.megatron, config.device, config.seed)
        self.arch = ModelArch.from_hf_config(read_hf_config(self.model_path))
        check_supported(self.arch)
        runtime.check_layout(config.megatron, self.world_size, self.arch.num_experts)
        self.coords = runtime.coords()
        self.padded_vocab = padded_vocab_size(self.arch.vocab_size, self.coords.tp_size)
        self.use_te = config.device == "cuda" and has_transformer_engine()
        self.tcfg = self._transformer_config(config.megatron)
        self.groups: ParallelGroups = runtime.groups()
        ckpt = HFCheckpoint(self.model_path)
        self.model = self._build_chunks(self.tcfg)
        load_hf_into(self.model, self.arch, ckpt, self.coords, self.padded_vocab)
        self.model = self._wrap_ddp(self.model)
        self.optimizer = self._build_optimizer()
        self.ref_model: list[torch.nn.Module] | None = None
        if config.ref_megatron is not None:
            ref_tcfg = self._transformer_config(config.ref_megatron)
            self.ref_model = self._build_chunks(ref_tcfg)
            load_hf_into(self.ref_model, self.arch, ckpt, self.coords, self.padded_vocab)
            for chunk in self.ref_model:
                chunk.requires_grad_(False)
                chunk.eval()
            if config.ref_megatron.param_offload:
                self._move(self.ref_model, "cpu")
        self._step = 0
        if config.megatron.use_remove_padding:
            # Packing (THD) needs Transformer Engine / MindSpeed attention; batches stay [B, L]
            # with right padding, which gives the same numbers (causal attention never looks
            # at the padding after a sequence).
            log.info("megatron engine runs unpacked [B, L] batches; use_remove_padding only saves compute")
        self._offload(after_step=True)
        log.info(
            "megatron engine ready", rank=self.rank, tp=self.coords.tp_size, pp=self.coords.pp_size,
            ep=self.coords.ep_size, etp=self.coords.etp_size, dp=ps.get_data_parallel_world_size(),
            transformer_engine=self.use_te, model_type=self.arch.model_type,
        )

    # ---- construction ------------------------------------------------------------------------

    def _materialize_initial_model(self) -> str:
        """Rank 0 builds the initial HF model (`model_init`) and saves it; every rank gets the
        directory (one host: the directory is local to it)."""
        import tempfile

        box: list[Any] = [None]
        if self.rank == 0:
            from services.common.tiny import build_tokenizer

            path = tempfile.mkdtemp(prefix="meshrl-megatron-init-")
            model = self.cfg.model_init()
            model.save_pretrained(path)
            try:
                build_tokenizer().save_pretrained(path)
            except Exception:  # noqa: BLE001 -- the tokenizer is a convenience for save_hf only
                log.warning("could not save a tokenizer next to the initial model", path=path)
            box = [path]
        dist.broadcast_object_list(box, src=0)
        return str(box[0])

    def _before_model_parallel_init(self) -> None:
        """Hook for subclasses (MindSpeed applies its patches here)."""

    def _transformer_config(self, m: Any) -> TransformerConfig:
        base = transformer_config_kwargs(
            self.arch, m, dtype=self.cfg.dtype, cpu=self.device_kind == "cpu", transformer_engine=self.use_te
        )
        if self.cfg.gradient_checkpointing and "recompute_granularity" not in m.override_transformer_config:
            base.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        overrides = self._transformer_overrides(m)
        return build_dataclass(TransformerConfig, base, overrides, "override_transformer_config")

    def _transformer_overrides(self, m: Any) -> dict[str, Any]:
        """override_transformer_config restricted to TransformerConfig fields (MindSpeed splits off its own)."""
        return dict(m.override_transformer_config)

    def _build_chunks(self, tcfg: TransformerConfig) -> list[torch.nn.Module]:
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        chunks = []
        for vp_stage in range(vpp or 1):
            stage = vp_stage if vpp else None
            spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=self.use_te, normalization="RMSNorm", vp_stage=stage)
            if not self.use_te:
                spec = localize_norms(spec)
            model = GPTModel(
                config=tcfg,
                transformer_layer_spec=spec,
                vocab_size=self.padded_vocab,
                max_sequence_length=self.arch.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=self.arch.tie_word_embeddings,
                position_embedding_type="rope",
                rotary_base=int(self.arch.rope_theta),
                vp_stage=stage,
            )
            chunks.append(model.to(self.device))
        return chunks

    def _wrap_ddp(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        m = self.cfg.megatron
        ddp_cfg = build_dataclass(DistributedDataParallelConfig, ddp_config_kwargs(m), m.override_ddp_config, "override_ddp_config")
        wrapped = [
            DistributedDataParallel(config=self.tcfg, ddp_config=ddp_cfg, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        return list(wrapped)

    def _build_optimizer(self) -> Any:
        """megatron's optimizer (distributed, offloadable) from OptimizerConfig with
        override_optimizer_config applied. On CPU the same OptimizerConfig is built (so overrides
        are validated and lr/betas/eps/weight_decay/clip_grad take effect) and CpuOptimizer runs it."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        m = self.cfg.megatron
        kw = optimizer_config_kwargs(self.cfg.optim, m, dtype=self.cfg.dtype, grad_clip=self.cfg.grad_clip)
        if self.device_kind == "cpu":
            kw.update(use_distributed_optimizer=False, optimizer_cpu_offload=False)
        ocfg = build_dataclass(OptimizerConfig, kw, m.override_optimizer_config, "override_optimizer_config")
        self.optimizer_config = ocfg
        # The schedule's peak is whatever OptimizerConfig ended up with (an `lr` override wins).
        self._schedule_optim = self.cfg.optim.model_copy(update={"lr": ocfg.lr})
        if self.device_kind == "cpu":
            return CpuOptimizer(self.model, ocfg)
        optimizer = get_megatron_optimizer(ocfg, self.model)
        # The schedule multiplies each micro-batch's loss by the optimizer's loss scale only through
        # grad_scale_func (Megatron-LM's training loop sets it); the optimizer unscales the
        # gradients by it either way, so without it an fp16 run stepped on gradients 2**32 times
        # too small. bf16 / fp32 optimizers scale by 1.
        self.tcfg.grad_scale_func = optimizer.scale_loss
        return optimizer

    # ---- data --------------------------------------------------------------------------------

    def _inputs(self, mb: SequenceBatch, pad_to: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        ids = mb.input_ids.to(self.device)
        if pad_to is not None and (pad_to[0] > ids.shape[0] or pad_to[1] > ids.shape[1]):
            ids = torch.nn.functional.pad(ids, (0, pad_to[1] - ids.shape[1], 0, pad_to[0] - ids.shape[0]))
        b, s = ids.shape
        if self.tcfg.sequence_parallel and s % self.coords.tp_size:
            # SP splits the sequence over TP ranks: pad on the right (causal attention keeps
            # real tokens unaffected; _token_logprobs drops the extra positions).
            extra = self.coords.tp_size - s % self.coords.tp_size
            ids = torch.cat([ids, ids.new_zeros((b, extra))], dim=1)
            s += extra
        pos = torch.arange(s, device=self.device).unsqueeze(0).expand(b, s)
        # True = masked (megatron convention); right padding needs only the causal mask.
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.device), diagonal=1).view(1, 1, s, s)
        return {"input_ids": ids, "position_ids": pos, "attention_mask": mask}

    def _token_logprobs(
        self, logits: torch.Tensor, mb: SequenceBatch, temperature: float, with_entropy: bool
    ) -> ForwardOutput:
        """logits [B, L, V/TP] at positions 0..L-1 predict tokens 1..L; shift to the contract's
        alignment (position t holds log p(x_t | x_<t); position 0 is 0)."""
        ids = mb.input_ids.to(logits.device)
        logits = logits[: ids.shape[0], : ids.shape[1]]
        tp_rank, tp_size = self.coords.tp_rank, self.coords.tp_size
        lp, ent = vocab_parallel_logprobs(
            logits[:, :-1], ids[:, 1:], vocab_start=tp_rank * logits.shape[-1], vocab_size=self.arch.vocab_size,
            temperature=temperature, with_entropy=with_entropy, tp_group=self.groups.tp, tp_size=tp_size,
        )
        zeros = torch.zeros_like(ids[:, :1], dtype=lp.dtype)
        mask = mb.response_mask.to(lp.device)
        logprobs = torch.cat([zeros, lp], dim=1) * mask
        entropy = torch.cat([zeros, ent], dim=1) * mask if ent is not None else None
        return ForwardOutput(logprobs=logprobs, entropy=entropy)

    # ---- the contract ------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(
        self, batch: SequenceBatch, *, temperature: float = 1.0, with_entropy: bool = False, reference: bool = False
    ) -> ForwardOutput:
        model = self.ref_model if reference else self.model
        if model is None:
            raise ConfigError("compute_logprobs(reference=True) needs a reference model: set actor_rollout_ref.actor.use_kl_loss")
        self._onload(model, reference)
        if batch.num_seqs == 0:
            # an empty DP share (a batch with fewer sequences than DP ranks): a forward of one
            # dummy keeps this replica's collectives (MoE's expert-parallel all-to-all) in step
            micro = self._dummies()
        else:
            size = self.cfg.log_prob_micro_batch_size or batch.num_seqs
            micro = [batch.select(list(range(i, min(i + size, batch.num_seqs)))) for i in range(0, batch.num_seqs, size)]
            micro = self._fit_schedule(micro)
        outputs: list[ForwardOutput] = []

        def loss_func(mb: SequenceBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            fo = self._token_logprobs(output, mb, temperature, with_entropy)
            outputs.append(fo)
            return output.new_zeros(()), {}

        for chunk in model:
            chunk.eval()
        self._run_schedule(model, micro, loss_func, forward_only=True)
        for chunk in model:
            chunk.train()
        if batch.num_seqs == 0:
            # Every stage of this pipeline holds the same empty share, so all of them skip the
            # broadcast (under VPP the last stage has one output per dummy, the others would
            # expect one: mismatched sizes).
            empty = torch.zeros(tuple(batch.input_ids.shape), dtype=torch.float32)
            result = ForwardOutput(logprobs=empty, entropy=empty.clone() if with_entropy else None)
        else:
            result = self._broadcast_from_last_stage(outputs, batch, with_entropy)
        self._offload_model(model, reference)
        return result

    def train_step(self, micro_batches: list[SequenceBatch], loss_fn: LossFn, *, temperature: float = 1.0) -> StepResult:
        self._onload(self.model, False)
        for chunk in self.model:
            chunk.zero_grad_buffer()  # type: ignore[operator]
        self.optimizer.zero_grad()
        # num_tokens reports the non-padding tokens (prompt and response) of the whole mini-batch,
        # as the FSDP engine's StepResult does; the loss is normalised by the response tokens.
        counts = torch.tensor(
            [sum(mb.num_response_tokens for mb in micro_batches), sum(mb.num_seqs for mb in micro_batches),
             sum(int(mb.attention_mask.sum().item()) for mb in micro_batches)],
            dtype=torch.float64, device=self.device,
        )
        dp_group = ps.get_data_parallel_group()
        dist.all_reduce(counts, group=dp_group)
        dp = ps.get_data_parallel_world_size()
        lr = lr_at(self._schedule_optim, self._step, self.cfg.total_training_steps)
        num_tokens = int(counts[2].item())
        if counts[0].item() == 0:
            # Every rank knows: nothing to learn from (e.g. the rollout correction rejected every
            # token); skipped together, as the FSDP engine does (its loss would divide by zero).
            log.warning("train_step_without_response_tokens", step=self._step)
            self._step += 1
            self._offload(after_step=True)
            skipped = {"actor/grad_norm_nonfinite": 0.0, "actor/step_skipped": 1.0}
            return StepResult(grad_norm=0.0, lr=lr, metrics=skipped, num_tokens=num_tokens, step=self._step)
        scale = LossScale(num_tokens=int(counts[0].item()), num_seqs=int(counts[1].item()), dp_size=dp)
        # An empty DP share (fewer sequences than DP ranks) runs dummies with a zero loss: the
        # gradient all-reduce over DP (and MoE's all-to-all) needs every rank.
        dummies = [] if micro_batches else self._dummies()
        micro_batches = dummies or self._fit_schedule(micro_batches)
        n_sched = len(micro_batches)
        metric_sums: dict[str, list[float]] = {}

        def loss_func(mb: SequenceBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            if any(mb is d for d in dummies):
                return output.float().sum() * 0.0, {}
            fo = self._token_logprobs(output, mb, temperature, with_entropy=True)
            loss, metrics = loss_fn(fo, mb, scale)
            for k, v in metrics.items():
                acc = metric_sums.setdefault(k, [0.0, 0.0])
                acc[0] += float(v)
                acc[1] += 1.0
            return loss * n_sched, {}

        self._run_schedule(self.model, micro_batches, loss_func, forward_only=False)
        updated, grad_norm = self._optimizer_step(lr)
        self._step += 1  # a skipped step counts too (the schedule moves on), as in the FSDP engine
        metrics = self._average_metrics(metric_sums)
        # On every step, as the FSDP engine reports them: the trainer averages each key over the
        # mini-batches that have it, so a key only on skipped steps would read 1.0.
        metrics["actor/grad_norm_nonfinite"] = 0.0 if math.isfinite(grad_norm) else 1.0
        metrics["actor/step_skipped"] = 0.0 if updated else 1.0
        self._offload(after_step=True)
        return StepResult(grad_norm=grad_norm, lr=lr, metrics=metrics, num_tokens=num_tokens, step=self._step)

    def _dummies(self) -> list[SequenceBatch]:
        """Stand-ins for an empty DP share: one all-padding sequence without response tokens, as
        many as the schedule needs (PP of them under VPP)."""
        pp = self.coords.pp_size
        group = getattr(self.tcfg, "microbatch_group_size_per_vp_stage", None) or pp
        dummy = dummy_batch(2, 0)
        return [dummy] * (1 if len(self.model) == 1 else group)

    def _fit_schedule(self, micro: list[SequenceBatch]) -> list[SequenceBatch]:
        """The interleaved (VPP) schedule needs at least PP micro-batches, and megatron refuses a
        count M whose remainder M % N (N = microbatch_group_size_per_vp_stage, default PP) is
        neither 0 nor >= PP: split the largest ones by sequences until the count fits. Losses are
        normalised globally (LossScale), so the summed gradient is the same however the sequences
        are grouped."""
        pp = self.coords.pp_size
        group = getattr(self.tcfg, "microbatch_group_size_per_vp_stage", None) or pp

        def fits(m: int) -> bool:
            return m >= pp and (m % group == 0 or m % group >= pp)

        if len(self.model) == 1 or fits(len(micro)):
            return micro
        micro = list(micro)
        while not fits(len(micro)):
            i = max(range(len(micro)), key=lambda j: micro[j].num_seqs)
            mb = micro[i]
            if mb.num_seqs < 2:
                raise ConfigError(
                    f"virtual pipeline parallelism needs at least pipeline_model_parallel_size={pp} micro-batches "
                    f"(a multiple of {group}), but only {sum(m.num_seqs for m in micro)} sequences are on this rank; "
                    "unset virtual_pipeline_model_parallel_size or give each rank more sequences"
                )
            half = mb.num_seqs // 2
            micro[i : i + 1] = [mb.select(list(range(half))), mb.select(list(range(half, mb.num_seqs)))]
        return micro

    def _run_schedule(self, model: list[torch.nn.Module], micro: list[SequenceBatch], loss_func: Any, forward_only: bool) -> None:
        data = iter(micro)
        vpp = len(model)
        pad_to = None
        if vpp > 1 and self.coords.pp_size == 2:
            # With PP=2 the previous and the next stage are one rank, and megatron 0.16 exchanges
            # the p2p tensor shapes in one batched call that pairs them in posting order, so the
            # peer may size an activation buffer with a gradient's shape. Every micro-batch padded
            # to one shape makes that harmless (the padding rows/columns are cut off again before
            # the loss, so they get no gradient).
            pad_to = (max(mb.num_seqs for mb in micro), max(int(mb.input_ids.shape[1]) for mb in micro))

        def forward_step(data_iterator: Iterator[SequenceBatch], chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            out = chunk(**self._inputs(mb, pad_to))
            return out, functools.partial(loss_func, mb)

        iters: Any = [iter(micro) for _ in range(vpp)] if vpp > 1 else data
        seq_len = max(int(mb.input_ids.shape[1]) for mb in micro)
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iters,
            model=model if vpp > 1 else model[0],
            num_microbatches=len(micro),
            seq_length=seq_len,
            micro_batch_size=max(mb.num_seqs for mb in micro),
            forward_only=forward_only,
        )

    def _optimizer_step(self, lr: float) -> tuple[bool, float]:
        """(updated, grad norm); the step is skipped when the norm is not finite."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if isinstance(self.optimizer, CpuOptimizer):
            ok, grad_norm, _ = self.optimizer.step()
        else:
            ok, grad_norm = _finite_step(self.optimizer)
        if not ok:
            log.warning("grad_norm_not_finite", step=self._step, grad_norm=grad_norm)
        return ok, grad_norm

    def _average_metrics(self, sums: dict[str, list[float]]) -> dict[str, float]:
        """Metrics exist on the last pipeline stage: the mean there over every micro-batch the
        schedule ran (after `_fit_schedule`'s splits) on every DP rank, as the FSDP engine reports
        it (a DP group never spans stages), then handed to every stage."""
        parts: list[Any] = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(parts, sums, group=ps.get_data_parallel_group())  # a rank of dummies has none
        merged: dict[str, list[float]] = {}
        for part in parts:
            for k, (total, n) in part.items():
                acc = merged.setdefault(k, [0.0, 0.0])
                acc[0] += total
                acc[1] += n
        return self._broadcast_metrics({k: total / n for k, (total, n) in sorted(merged.items())})

    def _broadcast_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.coords.pp_size == 1:
            return metrics
        box = [metrics]
        last = dist.get_process_group_ranks(self.groups.pp)[-1]
        dist.broadcast_object_list(box, src=last, group=self.groups.pp)
        return box[0]

    def _broadcast_from_last_stage(self, outputs: list[ForwardOutput], batch: SequenceBatch, with_entropy: bool) -> ForwardOutput:
        shape = tuple(batch.input_ids.shape)
        if outputs:
            logprobs = torch.cat([o.logprobs for o in outputs], dim=0)
            entropy = torch.cat([o.entropy for o in outputs], dim=0) if with_entropy else None  # type: ignore[misc]
        else:
            logprobs = torch.zeros(shape, dtype=torch.float32, device=self.device)
            entropy = torch.zeros(shape, dtype=torch.float32, device=self.device) if with_entropy else None
        if self.coords.pp_size > 1:
            last = dist.get_process_group_ranks(self.groups.pp)[-1]
            dist.broadcast(logprobs, src=last, group=self.groups.pp)
            if entropy is not None:
                dist.broadcast(entropy, src=last, group=self.groups.pp)
        return ForwardOutput(logprobs=logprobs.cpu(), entropy=entropy.cpu() if entropy is not None else None)

    # ---- offload -----------------------------------------------------------------------------

    def _buffers(self) -> list[Any]:
        out = []
        for chunk in self.model:
            out += list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))
        return out

    def _offload(self, after_step: bool) -> None:
        m = self.cfg.megatron
        if self.device_kind == "cpu" or not (m.param_offload or m.grad_offload):
            return
        for buf in self._buffers():
            buf.offload_to_cpu(move_params=m.param_offload, move_grads=m.grad_offload)

    def _onload(self, model: list[torch.nn.Module], reference: bool) -> None:
        if self.device_kind == "cpu":
            return
        if reference:
            if self.cfg.ref_megatron is not None and self.cfg.ref_megatron.param_offload:
                self._move(model, self.device)
            return
        m = self.cfg.megatron
        if m.param_offload or m.grad_offload:
            for buf in self._buffers():
                buf.reload_from_cpu(move_params=m.param_offload, move_grads=m.grad_offload)

    def _offload_model(self, model: list[torch.nn.Module], reference: bool) -> None:
        if reference:
            if self.device_kind != "cpu" and self.cfg.ref_megatron is not None and self.cfg.ref_megatron.param_offload:
                self._move(model, "cpu")
        else:
            self._offload(after_step=False)

    @staticmethod
    def _move(model: list[torch.nn.Module], device: Any) -> None:
        for chunk in model:
            chunk.to(device)

    # ---- weights and checkpoints -------------------------------------------------------------

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        self._onload(self.model, False)
        try:
            yield from export_hf(self.model, self.arch, self.coords, bucket_bytes, self.groups)
        finally:
            self._offload(after_step=False)

    def export_shards(self, bucket_bytes: int) -> Iterator[Bucket]:
        """This rank's own HF slices (its TP / expert-TP shard, its experts, its stage), copied on
        its device, with nothing from its replicas (shards.py). No collective."""
        self._onload(self.model, False)
        try:
            params = local_params(self.model, self.arch, self.coords)
            yield from group_by_bytes(owned_slices(params, self.arch, self.coords, runtime.replicas()), bucket_bytes)
        finally:
            self._offload(after_step=False)

    def save_hf(self, path: Path) -> None:
        from safetensors.torch import save_file

        out = Path(path)
        tensors: dict[str, torch.Tensor] = {}
        for bucket in self.export_weights(1 << 30):
            tensors.update({k: v.contiguous() for k, v in bucket})
        if self.rank == 0:
            import shutil

            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
            for name in os.listdir(self.model_path):
                if (name.endswith(".json") and not name.startswith("model.safetensors")) or name.endswith((".txt", ".model", ".jinja")):
                    shutil.copy(Path(self.model_path) / name, out / name)
        dist.barrier()

    def _ckpt_file(self, path: Path) -> Path:
        return Path(path) / f"rank_{self.rank:05d}.pt"

    def _layout(self) -> dict[str, int]:
        m = self.cfg.megatron
        return {
            "world_size": self.world_size, "tp": m.tensor_model_parallel_size, "pp": m.pipeline_model_parallel_size,
            "vpp": m.virtual_pipeline_model_parallel_size or 1, "cp": m.context_parallel_size,
            "ep": m.expert_model_parallel_size, "etp": m.expert_tensor_parallel_size or m.tensor_model_parallel_size,
        }

    def save_checkpoint(self, path: Path) -> None:
        """Per-rank files (same layout required to load); megatron's distributed optimizer
        state goes through its sharded_state_dict when it is in use."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._onload(self.model, False)
        state: dict[str, Any] = {
            "model": [unwrap(c).state_dict() for c in self.model],
            "step": self._step,
            "layout": self._layout(),
            "rng": {"cpu": torch.get_rng_state()},
        }
        if self.device_kind == "cuda":
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            state["rng"]["cuda"] = torch.cuda.get_rng_state()
            state["rng"]["tracker"] = get_cuda_rng_tracker().get_states()
        state["optimizer"] = self.optimizer.state_dict()
        if self.device_kind != "cpu" and self.cfg.megatron.use_distributed_optimizer:
            state["optimizer_param_state"] = _dist_opt_param_state(self.optimizer)
        torch.save(state, self._ckpt_file(path))
        if self.rank == 0:
            (path / "meshrl_megatron.json").write_text(json.dumps({"layout": self._layout(), "step": self._step}))
        dist.barrier()
        self._offload(after_step=False)

    def load_checkpoint(self, path: Path) -> None:
        path = Path(path)
        state = torch.load(self._ckpt_file(path), map_location="cpu", weights_only=False)
        if state["layout"] != self._layout():
            raise ConfigError(
                f"checkpoint {path} was written with layout {state['layout']}, this run has {self._layout()}; "
                "resume with the same parallel sizes"
            )
        self._onload(self.model, False)
        for chunk, sd in zip(self.model, state["model"], strict=True):
            unwrap(chunk).load_state_dict(sd, strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        if "optimizer_param_state" in state:
            _load_dist_opt_param_state(self.optimizer, state["optimizer_param_state"])
        elif self.device_kind != "cpu" and hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()
        self._step = int(state["step"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and self.device_kind == "cuda":
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            torch.cuda.set_rng_state(state["rng"]["cuda"])
            get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
        dist.barrier()
        self._offload(after_step=False)

    # ---- decoupled PPO, data-parallel coordinates, teardown ------------------------------------

    @property
    def dp_rank(self) -> int:
        """Which share of the data this rank gets (TP/PP ranks of one replica get the same)."""
        return int(ps.get_data_parallel_rank())

    @property
    def dp_size(self) -> int:
        return int(ps.get_data_parallel_world_size())

    def _actor_params(self) -> list[torch.Tensor]:
        return [p for chunk in self.model for p in unwrap(chunk).parameters()]

    @torch.no_grad()
    def snapshot_proximal(self) -> None:
        """Keep this rank's shards of the current parameters (on CPU) as the proximal policy."""
        self._onload(self.model, False)
        self._proximal = [p.detach().to("cpu", copy=True) for p in self._actor_params()]
        self._offload(after_step=False)

    def compute_proximal_logprobs(self, batch: SequenceBatch, *, temperature: float = 1.0) -> ForwardOutput:
        from services.common.errors import FailedPrecondition

        if self._proximal is None:
            raise FailedPrecondition("no proximal snapshot yet: call snapshot_proximal() at the start of the sync window")
        self._onload(self.model, False)
        params = self._actor_params()
        with torch.no_grad():
            current = [p.detach().to("cpu", copy=True) for p in params]
            for p, saved in zip(params, self._proximal, strict=True):
                p.copy_(saved)
        try:
            return self.compute_logprobs(batch, temperature=temperature)
        finally:
            with torch.no_grad():
                self._onload(self.model, False)
                for p, saved in zip(params, current, strict=True):
                    p.copy_(saved)
            self._offload(after_step=False)

    def close(self) -> None:
        """Drop the reference model and snapshots and megatron's model-parallel state."""
        self._proximal = None
        self.ref_model = None
        runtime.destroy_model_parallel()
        if self.device_kind == "cuda":
            torch.cuda.empty_cache()

    def memory_stats(self) -> dict[str, float]:
        return device_memory_stats(_DeviceRef(self.device_kind), self.local_rank)

    @property
    def step(self) -> int:
        return self._step

    def shutdown(self) -> None:
        """Alias of close()."""
        self.close()


def _dist_opt_param_state(optimizer: Any) -> Any:
    """Each sub-optimizer's (DistributedOptimizer) local fp32 main params and Adam moments."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [sub.get_parameter_state_dp_reshardable() if hasattr(sub, "get_parameter_state_dp_reshardable") else None for sub in subs]


def _load_dist_opt_param_state(optimizer: Any, states: Any) -> None:
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    for sub, st in zip(subs, states, strict=True):
        if st is None:
            continue
        # megatron 0.16's loader skips entries flagged "padding", a flag that only its sharded
        # (dist-checkpointing) form adds; get_parameter_state_dp_reshardable() holds parameters only.
        for key, per_dtype in st.items():
            if isinstance(key, int):
                for buckets in per_dtype.values():
                    for bucket in buckets:
                        for entry in bucket:
                            entry.setdefault("padding", False)
        # It copies into the main params in place; for fp32 models those are views of the
        # (grad-requiring) model params, which autograd refuses outside no_grad.
        with torch.no_grad():
            sub.load_parameter_state_from_dp_reshardable(st)


def _DeviceRef(kind: str) -> DeviceInfo:
    return DeviceInfo(kind, collective_backend(kind), ray_resource(kind), 1)  # type: ignore[arg-type]


@torch.no_grad()
def _finite_step(optimizer: Any) -> tuple[bool, float]:
    """megatron's `optimizer.step()` (ChainedOptimizer's: prepare, norm, clip, step), skipped when
    the gradient norm is not finite. megatron itself skips only on an fp16 loss-scale overflow; in
    bf16 / fp32 a NaN norm makes its clipping a no-op and Adam steps every weight to NaN, where the
    FSDP engine skips the step. The norm is always computed (megatron's FP32 optimizer reports
    none without clipping): it is reduced over the model-parallel group, so every rank decides
    alike."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():  # fp16: inf/nan found while unscaling (megatron lowered the loss scale)
        return False, float("nan")
    grad_norm = float(optimizer.get_grad_norm() or 0.0)
    if not math.isfinite(grad_norm):
        return False, grad_norm
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(
                params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    return bool(optimizer.step_with_ready_grads()), grad_norm
