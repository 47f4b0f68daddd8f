"""The actor loss the engine backpropagates: policy gradient (+ off-policy correction), minus the
entropy bonus, plus the KL-to-reference loss (verl `dp_actor.update_policy`).

    loss = pg(agg) - entropy_coeff * entropy(agg) + kl_loss_coef * kl(agg)

Every term is aggregated with `actor.loss_agg_mode` and the step's `LossScale`, following the
micro-batch convention of `agg.py` (sum over micro-batches and ranks / dp_size = mini-batch loss;
each micro-batch loss is multiplied by dp_size because DDP/FSDP average gradients). GSPO's pg term
follows `loss_agg_mode` too (verl 0.9.1; set `seq-mean-token-mean` for the paper's objective).

Masks: the pg term uses the response mask minus tokens rejected by `rollout_rs`; the entropy and KL
terms use `batch.response_mask` (in decoupled mode that mask already lost the rejected tokens when
the trainer called `apply_rollout_correction`; in bypass mode rejection happens here and, as in
verl, only the pg term drops the rejected tokens).

Metrics are the micro-batch's own values (its own normalizers, not multiplied by dp_size), so their
mean over micro-batches and ranks, which the engine reports, estimates the mini-batch value:
`actor/pg_loss`, `actor/pg_clipfrac`, `actor/pg_clipfrac_lower`, `actor/ppo_kl`, `actor/entropy`
(when the engine returned entropy), `actor/kl_loss` and `actor/kl_coef` (with `use_kl_loss`),
`rollout_corr/*` (see correction.py), and in bypass mode, when the batch carries
`at_trainer_version`, the token sums that `mismatch.finish_loss_sums` turns into the engine
mismatch and the off-policy KL (see mismatch.py).
"""

from __future__ import annotations

import torch

from services.common.config.actor_rollout_ref import ActorConfig
from services.common.config.algorithm import AlgorithmConfig
from services.common.errors import InvalidArgument
from services.trainer.engines.base import ForwardOutput, LossFn, LossScale, SequenceBatch

from .agg import agg_loss, metrics_to_floats
from .correction import IS_WEIGHTS_KEY, compute_rollout_correction, diagnose_mismatch
from .kl import kl_penalty
from .mismatch import VERSION_MASK_KEY, loss_sums
from .policy_loss import gspo_loss, ppo_clip_loss, reinforce_loss


def _tensor(batch: SequenceBatch, key: str, why: str) -> torch.Tensor:
    if key not in batch.tensors:
        raise InvalidArgument(f"batch.tensors[{key!r}]", f"missing; {why} (present: {sorted(batch.tensors)})")
    value = batch.tensors[key]
    if value.shape != batch.response_mask.shape:
        raise InvalidArgument(f"batch.tensors[{key!r}]", f"shape {tuple(value.shape)} != response_mask {tuple(batch.response_mask.shape)}")
    return value.float()


def build_loss_fn(actor: ActorConfig, algo: AlgorithmConfig) -> LossFn:
    """The `LossFn` for these configs (validated here, once, not per micro-batch).

    Reads batch.tensors["advantages"], ["old_logprobs"] (= rollout logprobs in bypass mode,
    proximal logprobs in decoupled mode), ["rollout_logprobs"] (behaviour; needed in decoupled mode
    when IS or rejection is configured, unless `apply_rollout_correction` already wrote
    ["rollout_is_weights"]; otherwise only used for `rollout_corr/*` diagnostics; unused in bypass
    mode, where old is the behaviour) and ["ref_logprobs"] when `actor.use_kl_loss`. Needs
    ForwardOutput.entropy when `actor.entropy_coeff != 0` (reports `actor/entropy` whenever given).
    The returned function syncs the device once per call (metrics to floats).
    """
    clip_low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    clip_high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    clip_c = actor.clip_ratio_c
    mode = actor.loss_agg_mode
    loss_mode = actor.policy_loss.loss_mode
    factor = actor.loss_scale_factor
    if "seq-mean-token-sum-norm" == mode and factor is None:
        raise InvalidArgument(
            "actor_rollout_ref.actor.loss_scale_factor",
            "loss_agg_mode=seq-mean-token-sum-norm needs it; set it (e.g. to data.max_response_length)",
        )
    rc = algo.rollout_correction
    bypass = rc.bypass_mode
    reinforce = rc.loss_type == "reinforce"
    corrects = rc.rollout_is is not None or rc.rollout_rs is not None
    if reinforce and not bypass:
        raise InvalidArgument("algorithm.rollout_correction.loss_type", "reinforce needs bypass_mode=true")
    if reinforce and loss_mode == "gspo":
        raise InvalidArgument(
            "actor_rollout_ref.actor.policy_loss.loss_mode",
            "gspo cannot be combined with rollout_correction.loss_type=reinforce; pick one",
        )
    entropy_coeff = actor.entropy_coeff
    use_kl = actor.use_kl_loss
    kl_coef = actor.kl_loss_coef
    kl_type = actor.kl_loss_type

    def loss_fn(out: ForwardOutput, batch: SequenceBatch, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.response_mask.float()
        logp = out.logprobs.float()
        if logp.shape != mask.shape:
            raise InvalidArgument("ForwardOutput.logprobs", f"shape {tuple(logp.shape)} != response_mask {tuple(mask.shape)}")
        adv = _tensor(batch, "advantages", "compute_advantages(batch, cfg) output")
        old = _tensor(batch, "old_logprobs", "rollout logprobs (bypass) or recomputed proximal logprobs (decoupled)")
        metrics: dict[str, torch.Tensor | float] = {}

        pg_mask = mask
        is_weights: torch.Tensor | None = None
        if bypass:
            # old == behaviour; compare it with the current policy (detached), per micro-batch.
            corr = compute_rollout_correction(logp.detach(), old, mask, rc)
            pg_mask = corr.keep_mask.float()
            metrics.update(corr.metrics)
            if reinforce:
                is_weights = corr.weights
            if VERSION_MASK_KEY in batch.tensors:  # engine vs off-policy mismatch (algos/mismatch.py)
                metrics.update(loss_sums(logp, old, mask, _tensor(batch, VERSION_MASK_KEY, "")))
        elif IS_WEIGHTS_KEY in batch.tensors:
            is_weights = _tensor(batch, IS_WEIGHTS_KEY, "written by apply_rollout_correction")
            if "rollout_logprobs" in batch.tensors:
                # pi_old vs pi_rollout on the kept tokens (apply_rollout_correction's own metrics
                # cover the whole batch before rejection)
                metrics.update(diagnose_mismatch(old, _tensor(batch, "rollout_logprobs", ""), mask))
        else:
            if rc.rollout_is_batch_normalize:
                raise InvalidArgument(
                    "algorithm.rollout_correction.rollout_is_batch_normalize",
                    "needs the whole batch: call apply_rollout_correction(batch, algo) before splitting it",
                )
            if "rollout_logprobs" in batch.tensors or corrects:
                rollout = _tensor(batch, "rollout_logprobs", "decoupled mode corrects pi_old against the rollout policy")
                corr = compute_rollout_correction(old, rollout, mask, rc)
                pg_mask = corr.keep_mask.float()
                is_weights = corr.weights
                metrics.update(corr.metrics)

        if bypass and reinforce:
            pg_mat, pg_metrics = reinforce_loss(old, logp, adv, pg_mask, is_weights)
        elif loss_mode == "gspo":
            pg_mat, pg_metrics = gspo_loss(old, logp, adv, pg_mask, clip_low, clip_high, is_weights)
        else:
            pg_mat, pg_metrics = ppo_clip_loss(old, logp, adv, pg_mask, clip_low, clip_high, clip_c, is_weights)
        metrics.update(pg_metrics)
        loss = agg_loss(pg_mat, pg_mask, mode, scale, factor)
        metrics["actor/pg_loss"] = agg_loss(pg_mat.detach(), pg_mask, mode, None, factor)

        if out.entropy is not None:
            entropy = out.entropy.float()
            metrics["actor/entropy"] = agg_loss(entropy.detach(), mask, mode, None, factor)
            if entropy_coeff != 0.0:
                loss = loss - entropy_coeff * agg_loss(entropy, mask, mode, scale, factor)
        elif entropy_coeff != 0.0:
            raise InvalidArgument(
                "ForwardOutput.entropy", f"actor.entropy_coeff={entropy_coeff} needs the engine to return entropy"
            )

        if use_kl:
            ref = _tensor(batch, "ref_logprobs", "actor.use_kl_loss=true needs reference logprobs")
            kld = kl_penalty(logp, ref, kl_type)
            loss = loss + kl_coef * agg_loss(kld, mask, mode, scale, factor)
            metrics["actor/kl_loss"] = agg_loss(kld.detach(), mask, mode, None, factor)
            metrics["actor/kl_coef"] = kl_coef
        return loss, metrics_to_floats(metrics)  # the loss function's only device sync

    return loss_fn
