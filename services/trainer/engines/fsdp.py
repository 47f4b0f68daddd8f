"""The `fsdp` training engine: torch FSDP2 (`fully_shard`) over a Hugging Face causal LM, on
cuda, npu or cpu (gloo), with one rank or many.

Per rank:

    build     rank 0 loads the weights, other ranks build on the meta device; every decoder layer
              and the root are fully_shard-ed; weights (and buffers) are broadcast from rank 0.
              One rank in full precision stays a plain module: nothing to shard, and FSDP2's
              hooks alone cost 12% of a step on small batches.
              The reference policy (if any) is a second sharded copy of the initial weights;
              with LoRA (fsdp_lora.py) it is the base with the adapter disabled.
    forward   a micro-batch is either packed into one varlen row (use_remove_padding) or kept as
              right-padded rows; with Ulysses SP each rank of an SP group runs 1/S of the row and
              the per-token logprobs are gathered back, so every SP rank sees the whole batch.
    train     micro-batches forward/backward (ranks run the same number: shorter lists get
              zero-weight dummies), grad clip, AdamW, LR schedule step.

Gradient bookkeeping: FSDP averages gradients over all W = dp * sp ranks. A loss function returns
(sum of its micro-batch token losses / global normalizer) * dp_size (LossScale), and SP ranks
all compute the same loss, so the engine back-propagates loss * sp: the averaged gradient is then
exactly the gradient of the mini-batch loss.
"""

from __future__ import annotations

import collections
import copy
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from services.common.device import DeviceInfo, collective_backend, import_torch_npu, ray_resource
from services.common.device import memory_stats as device_memory_stats
from services.common.errors import FailedPrecondition
from services.common.logging import get_logger
from services.common.released import check_freeze, released_layout
from services.weights import Bucket
from services.weights.adapter import AdapterSpec, base_identity_for
from services.weights.layout import group_by_bytes
from services.weights.packing import pack_stream

from . import attention, fsdp_lora, hf_model, ulysses
from .base import EngineSpec, ForwardOutput, LossFn, LossScale, SequenceBatch, StepResult, TrainEngine, register_engine
from .batching import dummy_batch, micro_batch_indices, pack, token_budget, trim, unpack_next_token
from .dist import all_gather_objects, all_reduce_cpu, build_meshes, init_process_group
from .fsdp_shards import local_shards
from .fsdp_state import load_state, save_hf_weights, save_state
from .optim import build_optimizer

log = get_logger(__name__)


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[label] and the entropy of softmax(logits / T), in float32."""
    z = logits.float() / temperature if temperature != 1.0 else logits.float()
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return lp, ent


@register_engine("fsdp", "cpu", "cuda", "npu")
class FSDPEngine(TrainEngine):
    """See the module docstring. Not thread-safe: one caller per rank."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        if spec.device == "npu":
            import_torch_npu()
        self.rank, self.world_size = init_process_group(spec.device, spec.collective_timeout_s)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if spec.device == "cpu":
            self.device = torch.device("cpu")
        else:
            self.device = torch.device(spec.device, local_rank)
            getattr(torch, spec.device).set_device(self.device)
        actor, model_cfg = spec.actor, spec.model
        fsdp_cfg = actor.fsdp_config
        self.sp = actor.ulysses_sequence_parallel_size
        if model_cfg.path is not None:
            hf_config = hf_model.load_config(model_cfg)
        else:
            if spec.model_init is None:
                raise FailedPrecondition("actor_rollout_ref.model.path is null and no built-in model was supplied")
            hf_config = hf_model.config_from_init(model_cfg, spec.model_init)
        hf_model.check_compat(hf_config, model_cfg, actor)
        # A released multimodal checkpoint trains as its language model (services/common/released.py).
        self.released = released_layout(model_cfg.path)
        check_freeze(self.released, actor.freeze_vision_tower)
        self.meshes = build_meshes(spec.device, self.world_size, self.sp, fsdp_cfg.fsdp_size)
        # one rank in full precision: a plain module (FSDP2 would only add its hooks)
        self.sharded = self.world_size > 1 or fsdp_cfg.mixed_precision != "none"
        self.hf_config = hf_config
        tc = hf_model.text_config(hf_config)
        self.pad_token_id = int(tc.pad_token_id if getattr(tc, "pad_token_id", None) is not None else 0)
        self.remove_padding = model_cfg.use_remove_padding
        self.dtype = hf_model.master_dtype(model_cfg, actor)
        mp = actor.fsdp_config.mixed_precision
        attn = hf_model.attn_implementation(spec.device, hf_model.DTYPES[mp] if mp != "none" else self.dtype)
        self._attn = attn
        # packing and Ulysses run through the engine's own attention (attention.py)
        self._custom_attn = self.remove_padding or self.sp > 1
        self._flash = attention.flash_available(spec.device)
        if self._custom_attn:
            attention.register()
        torch.manual_seed(spec.seed)
        materialize = self.rank == 0
        model = hf_model.build_model(
            model_cfg, hf_config, dtype=self.dtype, attn=attn, materialize=materialize, model_init=spec.model_init
        )
        self.generation_config = getattr(model, "generation_config", None)
        self.lora = model_cfg.lora_rank > 0
        self.base_model = ""
        if self.lora:  # the base's identity before peft wraps it (rank 0 holds real weights)
            self.base_model = base_identity_for(model, model_cfg.path) if materialize else ""
            model = fsdp_lora.wrap(model, model_cfg)
        full_state: dict[str, Any] = {k: v.detach() for k, v in model.state_dict().items()} if materialize else {}
        if model_cfg.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = self._shard(model, full_state)
        del full_state
        self.ref_model: Any = None
        if spec.ref is not None and not self.lora:  # with LoRA the reference is the adapter disabled
            self.ref_model = self._clone_frozen()
        self.optimizer, self.scheduler = build_optimizer(
            [p for p in self.model.parameters() if p.requires_grad], actor.optim, spec.total_training_steps, spec.device
        )
        self._step = 0
        self._proximal: list[torch.Tensor] | None = None
        torch.manual_seed(spec.seed + self.rank)
        random.seed(spec.seed + self.rank)
        self._param_offload = fsdp_cfg.param_offload
        self._optim_offload = fsdp_cfg.optimizer_offload
        self._ref_offload = self.ref_model is not None and spec.ref is not None and spec.ref.fsdp_config.param_offload
        if self._param_offload:
            self._move(self.model, "cpu")
        if self._ref_offload:
            self._move(self.ref_model, "cpu")
        log.info(
            "fsdp_engine_ready", rank=self.rank, world_size=self.world_size, sp=self.sp, device=str(self.device),
            model_type=getattr(hf_config, "model_type", "?"), params=sum(p.numel() for p in self.model.parameters()),
            remove_padding=self.remove_padding, reference=spec.ref is not None, sharded=self.sharded,
            lora_rank=model_cfg.lora_rank, trainable=sum(p.numel() for p in self.model.parameters() if p.requires_grad),
        )

    # ---- construction ----------------------------------------------------------------------

    def _fsdp_kwargs(self) -> dict[str, Any]:
        fsdp_cfg = self.spec.actor.fsdp_config
        mp = MixedPrecisionPolicy()
        if fsdp_cfg.mixed_precision != "none":
            mp = MixedPrecisionPolicy(param_dtype=hf_model.DTYPES[fsdp_cfg.mixed_precision], reduce_dtype=torch.float32)
        return {"mesh": self.meshes.fsdp, "mp_policy": mp, "reshard_after_forward": fsdp_cfg.reshard_after_forward}

    def _wrap(self, model: Any) -> None:
        """fully_shard every decoder layer and the root; a no-op with one rank and no mixed
        precision, where sharding has nothing to split and its per-layer hooks (copy-in/out,
        DTensor bookkeeping) cost 12% of a step on the built-in example's batch on CPU."""
        if not self.sharded:
            model.to(self.device)  # fully_shard would have moved it
            return
        units = set(getattr(model, "_no_split_modules", None) or [])
        kwargs = self._fsdp_kwargs()
        for module in model.modules():
            if type(module).__name__ in units:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)

    def _shard(self, model: Any, full_state: dict[str, Any]) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self._custom_attn:
            model.set_attn_implementation(attention.ATTN_NAME)
        self._wrap(model)
        if self.rank != 0:
            model.to_empty(device=self.device)
        if self.world_size > 1:
            set_model_state_dict(
                model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            )
            for buf in model.buffers():  # non-persistent buffers (rotary inv_freq) are not in the state dict
                dist.broadcast(buf, src=0)
        return model

    def _clone_frozen(self) -> Any:
        """A (sharded, like the actor) copy of the current (initial) actor weights, without gradients."""
        from transformers import AutoModelForCausalLM

        if not self.sharded:  # a plain module: a deep copy keeps tied weights tied
            ref = copy.deepcopy(self.model)
            ref.requires_grad_(False)
            ref.eval()
            return ref
        with torch.device("meta"):
            ref = AutoModelForCausalLM.from_config(self.hf_config, dtype=self.dtype, attn_implementation=self._attn,
                                                   trust_remote_code=self.spec.model.trust_remote_code)
        if self._custom_attn:
            ref.set_attn_implementation(attention.ATTN_NAME)
        self._wrap(ref)
        ref.to_empty(device=self.device)
        with torch.no_grad():
            for dst, src in zip(ref.parameters(), self.model.parameters(), strict=True):
                _local(dst).copy_(_local(src))
            for dst, src in zip(ref.buffers(), self.model.buffers(), strict=True):
                dst.copy_(src)
        ref.requires_grad_(False)
        ref.eval()
        return ref

    # ---- offload ---------------------------------------------------------------------------

    def _move(self, model: Any, device: str | torch.device) -> None:
        model.to(device)

    def _move_optimizer(self, device: str | torch.device) -> None:
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)

    def _load_actor(self, with_optimizer: bool) -> None:
        if self._param_offload:
            self._move(self.model, self.device)
        if with_optimizer and self._optim_offload:
            self._move_optimizer(self.device)

    def _offload_actor(self) -> None:
        if self._param_offload:
            self._move(self.model, "cpu")
        if self._optim_offload:
            self._move_optimizer("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- forward ---------------------------------------------------------------------------

    def _forward(
        self, model: Any, mb: SequenceBatch, temperature: float, with_entropy: bool, entropy_grad: bool = True
    ) -> ForwardOutput:
        """Token-aligned logprobs (and entropy) [B, L] of one micro-batch, masked to responses."""
        b, length = mb.input_ids.shape
        sp = self.sp
        bounds: list[tuple[int, int]] | None = None
        attention_mask: torch.Tensor | None = None
        packed = None
        if self.remove_padding:
            packed = pack(mb, multiple_of=sp)
            ids, pos = packed.input_ids, packed.position_ids
            bounds = packed.bounds
        else:
            padded = length + (-length) % sp
            ids = torch.nn.functional.pad(mb.input_ids, (0, padded - length), value=self.pad_token_id)
            pos = torch.arange(padded, dtype=torch.long).unsqueeze(0).expand(b, -1)
            if sp == 1:
                attention_mask = mb.attention_mask.to(self.device)
        ids, pos = ids.to(self.device), pos.to(self.device)
        labels = torch.roll(ids, shifts=-1, dims=1)
        ctx = attention.AttnContext(
            sp_group=self.meshes.sp_group if sp > 1 else None, sp_size=sp, bounds=bounds, flash=self._flash,
        )
        rank = self.meshes.sp_rank if sp > 1 else 0
        attention.activate(ctx)
        logits = model(
            input_ids=ulysses.slice_seq(ids, rank, sp), position_ids=ulysses.slice_seq(pos, rank, sp),
            attention_mask=attention_mask, use_cache=False,
        ).logits
        lp, ent = token_logprobs(logits, ulysses.slice_seq(labels, rank, sp), temperature, with_entropy, entropy_grad)
        if sp > 1:
            lp = ulysses.gather_seq(lp, self.meshes.sp_group, dim=1)
            ent = ulysses.gather_seq(ent, self.meshes.sp_group, dim=1) if ent is not None else None
        del logits
        mask = mb.response_mask.to(self.device, dtype=torch.float32)
        if packed is not None:
            lp_full = unpack_next_token(lp[0], packed, (b, length))
            ent_full = unpack_next_token(ent[0], packed, (b, length)) if ent is not None else None
        else:
            lp_full = torch.cat([lp.new_zeros(b, 1), lp[:, : length - 1]], dim=1)
            ent_full = torch.cat([ent.new_zeros(b, 1), ent[:, : length - 1]], dim=1) if ent is not None else None
        return ForwardOutput(lp_full * mask, ent_full * mask if ent_full is not None else None)

    def _micro_indices(self, batch: SequenceBatch, max_seqs: int | None) -> list[list[int]]:
        actor = self.spec.actor
        if actor.use_dynamic_bsz:
            return micro_batch_indices(batch, max_tokens=token_budget(actor))
        return micro_batch_indices(batch, max_seqs=max_seqs)

    def _equalize(self, count: int) -> int:
        """The largest micro-batch count over all ranks (every rank must run that many)."""
        return int(all_reduce_cpu([float(count)], op="max")[0]) if self.world_size > 1 else count

    @torch.no_grad()
    def _no_grad_logprobs(
        self, model: Any, batch: SequenceBatch, temperature: float, with_entropy: bool, micro: int | None = None
    ) -> ForwardOutput:
        b, length = batch.input_ids.shape
        size = micro or self.spec.log_prob_micro_batch_size_per_gpu or self.spec.actor.ppo_micro_batch_size_per_gpu
        parts = self._micro_indices(batch, size)
        total = self._equalize(len(parts))
        logprobs = torch.zeros((b, length), dtype=torch.float32)
        entropy = torch.zeros((b, length), dtype=torch.float32) if with_entropy else None
        for i in range(total):
            if i >= len(parts):
                self._forward(model, dummy_batch(max(1, self.sp), self.pad_token_id), temperature, False)
                continue
            mb = trim(batch.select(parts[i]))
            out = self._forward(model, mb, temperature, with_entropy)
            width = mb.input_ids.shape[1]
            idx = torch.as_tensor(parts[i], dtype=torch.long)
            logprobs[idx, :width] = out.logprobs.float().cpu()
            if entropy is not None and out.entropy is not None:
                entropy[idx, :width] = out.entropy.float().cpu()
        return ForwardOutput(logprobs, entropy)

    # ---- the TrainEngine contract ----------------------------------------------------------

    @property
    def step(self) -> int:
        return self._step

    @property
    def dp_rank(self) -> int:
        return self.meshes.dp_rank

    @property
    def dp_size(self) -> int:
        return self.meshes.dp_size

    def compute_logprobs(
        self, batch: SequenceBatch, *, temperature: float = 1.0, with_entropy: bool = False, reference: bool = False
    ) -> ForwardOutput:
        if reference and self.lora and self.spec.ref is not None:
            self._load_actor(with_optimizer=False)
            self.model.eval()
            try:
                with self.model.disable_adapter():  # the base policy, from the same parameters
                    return self._no_grad_logprobs(self.model, batch, temperature, with_entropy,
                                                  self.spec.ref.log_prob_micro_batch_size_per_gpu)
            finally:
                if self._param_offload:
                    self._move(self.model, "cpu")
        if reference:
            if self.ref_model is None:
                raise FailedPrecondition(
                    "reference logprobs asked for but the engine has no reference policy (build it with ref=...; "
                    "actor_rollout_ref.actor.use_kl_loss=true does that in the trainer)"
                )
            if self._ref_offload:
                self._move(self.ref_model, self.device)
            try:
                micro = self.spec.ref.log_prob_micro_batch_size_per_gpu if self.spec.ref is not None else None
                return self._no_grad_logprobs(self.ref_model, batch, temperature, with_entropy, micro)
            finally:
                if self._ref_offload:
                    self._move(self.ref_model, "cpu")
        self._load_actor(with_optimizer=False)
        self.model.eval()
        try:
            return self._no_grad_logprobs(self.model, batch, temperature, with_entropy)
        finally:
            if self._param_offload:
                self._move(self.model, "cpu")

    def train_step(
        self, micro_batches: list[SequenceBatch], loss_fn: LossFn, *, temperature: float = 1.0
    ) -> StepResult:
        self._load_actor(with_optimizer=True)
        self.model.train()
        resp = sum(mb.num_response_tokens for mb in micro_batches)
        seqs = sum(mb.num_seqs for mb in micro_batches)
        tokens = sum(int(mb.attention_mask.sum().item()) for mb in micro_batches)
        count = len(micro_batches)
        if self.world_size > 1:
            maxed = all_reduce_cpu([float(count)], op="max")
            summed = all_reduce_cpu([float(resp), float(seqs), float(tokens)])
            count = int(maxed[0])
            resp, seqs, tokens = (round(x / self.sp) for x in summed)
        scale = LossScale(num_tokens=resp, num_seqs=seqs, dp_size=self.dp_size)
        want_entropy_grad = self.spec.actor.entropy_coeff != 0
        sums: dict[str, list[float]] = {}
        if resp == 0:  # every rank knows: nothing to learn from (e.g. all tokens rejected); skip together
            log.warning("train_step_without_response_tokens", step=self._step)
            count = 0
        for i in range(count):
            if i >= len(micro_batches):
                out = self._forward(self.model, dummy_batch(max(1, self.sp), self.pad_token_id), temperature, False)
                (out.logprobs.sum() * 0.0).backward()
                continue
            mb = micro_batches[i].to(self.device)
            out = self._forward(self.model, mb, temperature, True, entropy_grad=want_entropy_grad)
            loss, metrics = loss_fn(out, mb, scale)
            (loss * self.sp).backward()
            for key, value in metrics.items():
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += float(value)
                acc[1] += 1.0
        grad_norm = self._clip() if resp else 0.0
        lr = float(self.optimizer.param_groups[0]["lr"])
        finite = bool(torch.isfinite(torch.tensor(grad_norm)))
        if finite and resp:
            self.optimizer.step()
        elif not finite:
            log.warning("grad_norm_not_finite", step=self._step, grad_norm=grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._step += 1
        metrics_out = self._reduce_metrics(sums)
        metrics_out["actor/grad_norm_nonfinite"] = 0.0 if finite else 1.0
        metrics_out["actor/step_skipped"] = 0.0 if finite and resp else 1.0
        self._offload_actor()
        return StepResult(grad_norm=grad_norm, lr=lr, metrics=metrics_out, num_tokens=tokens, step=self._step)

    def _clip(self) -> float:
        max_norm = self.spec.actor.grad_clip if self.spec.actor.grad_clip > 0 else float("inf")
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm.item())

    def _reduce_metrics(self, sums: dict[str, list[float]]) -> dict[str, float]:
        """Mean over micro-batches and ranks (SP ranks hold the same values; that weighs each DP
        rank equally as well)."""
        merged: dict[str, list[float]] = {}
        for part in all_gather_objects(sums):
            assert isinstance(part, dict)
            for key, (total, n) in part.items():
                acc = merged.setdefault(key, [0.0, 0.0])
                acc[0] += total
                acc[1] += n
        return {k: total / n for k, (total, n) in merged.items() if n}

    def adapter_spec(self) -> AdapterSpec:
        """The trained adapter's descriptor (rank 0: it knows the base's identity)."""
        return fsdp_lora.spec_of(self.model, self.base_model, self.spec.model.path)

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        """Full CPU tensors by HF name (tied weights once, as save_pretrained writes them), each
        bucket packed into one host buffer (`pack_stream`: the tensors are views of it, each
        gathered parameter copied into its place and freed before the next is gathered); with
        LoRA the adapter alone, opened by its descriptor (fsdp_lora.export)."""
        self._load_actor(with_optimizer=False)
        params = list(self.model.named_parameters())

        def gathered() -> Iterator[torch.Tensor]:
            for _, param in params:
                full = param.full_tensor() if isinstance(param, DTensor) else param  # every rank takes part
                yield full.detach()

        try:
            if self.lora:
                yield from group_by_bytes(fsdp_lora.export(self), bucket_bytes)
            elif self.rank == 0:
                names = [self.released.to_released(n) if self.released is not None else n for n, _ in params]
                specs = [(name, tuple(p.shape), p.dtype) for name, (_, p) in zip(names, params, strict=True)]
                yield from pack_stream(specs, gathered(), bucket_bytes)
            else:
                collections.deque(gathered(), maxlen=0)  # the all-gathers rank 0 is running
        finally:
            if self._param_offload:
                self._move(self.model, "cpu")

    def export_shards(self, bucket_bytes: int) -> Iterator[Bucket]:
        """This rank's own rows of every parameter, copied on its device (fsdp_shards.py)."""
        self._load_actor(with_optimizer=False)
        try:
            rename = self.released.to_released if self.released is not None else None  # as export_weights
            yield from group_by_bytes(local_shards(self.model, self.rank, rename), bucket_bytes)
        finally:
            if self._param_offload:
                self._move(self.model, "cpu")

    def save_checkpoint(self, path: Path) -> None:
        self._load_actor(with_optimizer=True)
        try:
            save_state(self, Path(path))
        finally:
            self._offload_actor()

    def load_checkpoint(self, path: Path) -> None:
        self._load_actor(with_optimizer=True)
        try:
            load_state(self, Path(path))
        finally:
            self._offload_actor()

    def save_hf(self, path: Path) -> None:
        self._load_actor(with_optimizer=False)
        try:
            if self.lora:
                fsdp_lora.save_adapter(self, Path(path), merged=self.spec.model.lora_export_merged)
            else:
                save_hf_weights(self, Path(path))
        finally:
            if self._param_offload:
                self._move(self.model, "cpu")

    def memory_stats(self) -> dict[str, float]:
        kind = self.device.type
        info = DeviceInfo(kind, collective_backend(kind), ray_resource(kind), 1)  # type: ignore[arg-type]
        return device_memory_stats(info, self.device.index or 0)

    def snapshot_proximal(self) -> None:
        with torch.no_grad():
            self._proximal = [_local(p).detach().to("cpu", copy=True) for p in self._trained_params()]

    def compute_proximal_logprobs(self, batch: SequenceBatch, *, temperature: float = 1.0) -> ForwardOutput:
        if self._proximal is None:
            raise FailedPrecondition("no proximal snapshot yet: call snapshot_proximal() at the start of the sync window")
        self._load_actor(with_optimizer=False)
        params = self._trained_params()
        with torch.no_grad():
            current = [_local(p).detach().to("cpu", copy=True) for p in params]
            for p, saved in zip(params, self._proximal, strict=True):
                _local(p).copy_(saved)
        try:
            self.model.eval()
            return self._no_grad_logprobs(self.model, batch, temperature, False)
        finally:
            with torch.no_grad():
                for p, saved in zip(params, current, strict=True):
                    _local(p).copy_(saved)
            if self._param_offload:
                self._move(self.model, "cpu")

    def _trained_params(self) -> list[torch.Tensor]:
        """The parameters the optimizer changes (all of them, or the adapter's with LoRA)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def close(self) -> None:
        self._proximal = None
        self.ref_model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _local(p: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a (possibly sharded) parameter."""
    return p._local_tensor if isinstance(p, DTensor) else p  # type: ignore[attr-defined,no-any-return]


__all__ = ["FSDPEngine", "FSDPModule", "token_logprobs"]
