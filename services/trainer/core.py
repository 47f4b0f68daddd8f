"""The trainer loop: fetch groups, compute advantages and losses, step, publish, checkpoint.
No Ray, no gRPC server: the coordinator client, the training group, the weight publisher and the
RL math are injected (fakes in unit tests).

One local step s (FetchBatch's `step`):

    FetchBatch(s) ──▶ groups (DAPO: drop zero-variance groups, report them on the next fetch,
       ▲               fetch again until required_samples groups are kept)
       │          ──▶ SequenceBatch ──▶ advantages ──▶ old logprobs (bypass: rollout's; decoupled:
       │               proximal = parameters at the start of the sync window) ──▶ ref logprobs (KL)
       │          ──▶ require_batches mini-batches x ppo_epochs optimizer steps
       │          ──▶ every trigger_parameter_sync_step steps: export ─▶ publish ─▶ CommitVersion(v+1)
       └───────── ──▶ every save_freq steps (or when asked): checkpoint ─▶ ReportCheckpoint(s)

Overlap (`overlap=True`; off by default, on in the built-in example): while the group trains
step s, the loop waits for the previous version's publish to commit, then fetches step s+1's
groups with FetchBatch's `train_version` set to the version they will be trained at (the
coordinator measures staleness against it and counts them against the budget until that version
is committed, so the rollout runs no further ahead than without the overlap). After step s the group's export of v+1 is ordered
before any later group call, and the publish and CommitVersion(v+1) run while step s+1 trains.
Checkpoints, operator requests and the end of the run wait for the publish in flight; nothing a
step fetches is trained twice or dropped (a checkpoint at s leaves step s+1's groups delivered
after it, so a resume re-queues them).

Start: resume from the newest checkpoint (trainer.resume_mode; resume_path goes back to its path
once, restarts after it resume from the newest since: checkpoints.py), ResumeTrainer(step) so the
coordinator re-queues groups delivered after it, ReportCheckpoint(step) of the checkpoint loaded
(a trainer that died between committing and reporting it), then publish the restored weights as
the next version (the coordinator may have moved past the checkpoint's version before the crash).
Operator requests (checkpoint, stop) arrive as FetchBatch flags or through `request_checkpoint`
(SaveCheckpoint RPC) and are served at the next step boundary.

A collective broadcast (nccl / hccl / gloo, from rank 0) that fails after its CommitVersion made
the version current does not stop the loop: a peer gone or stalled mid-broadcast has the version
sent again, otherwise the rollout ranks that missed it load the next one (`_broadcast_failed`;
three failures in a row do stop it). A version that went through and then lost its only holder
(a single rollout replica killed right after loading it) is sent again when a fetch brings no
groups and the param server says the group waits for it (`_send_again_if_wanted`). Other
publishers retry a transient failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
import torch

from meshrl.v1 import common_pb2, coordinator_pb2, trainer_pb2
from services.common.errors import FailedPrecondition, MeshError, first_cause, root_cause, transient
from services.common.logging import get_logger
from services.weights import WeightPublisher

from . import checkpoints
from .algos.advantages import KL_REWARD_KEY
from .algos.dapo import dynamic_sampling_values
from .algos.mismatch import VERSION_MASK_KEY, finish_loss_sums, mismatch_k3, split_metrics, version_mask
from .convert import agent_metrics, check_batch, groups_to_batch, sequence_tensors, token_versions
from .engines.base import LossFn, SequenceBatch, StepResult
from .group import TrainGroup
from .publisher import RankZeroPublisher
from .retry import retry_transient

log = get_logger(__name__)

# Codes of a coordinator that is not up yet (see TrainerLoop._resume_trainer).
_NOT_UP_YET = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED})
_BROADCAST_FAILURES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS,
                                 grpc.StatusCode.FAILED_PRECONDITION})
_SEND_AGAIN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Broadcast failures after which the version is sent again (TrainerLoop._broadcast_failed)."""
MAX_FAILED_BROADCASTS_IN_A_ROW = 3
"""A collective broadcast may fail after its version went current (TrainerLoop._broadcast_failed);
this many in a row stop the loop: no rollout rank has followed the trainer for that long."""


def sequence_rewards(batch: SequenceBatch) -> torch.Tensor:
    """[B] reward of each sequence as trained on: the score minus its summed KL penalty when the
    batch carries one (use_kl_in_reward); verl's token_level_rewards.sum(-1)."""
    reward = batch.seq_tensors["reward"].float()
    if KL_REWARD_KEY in batch.tensors:
        reward = reward - batch.tensors[KL_REWARD_KEY].float().sum(dim=-1)  # masked when written
    return reward


class CoordinatorLike(Protocol):
    """The trainer side of services.coordinator.client.CoordinatorClient."""

    async def fetch_batch(
        self, trainer_id: str, step: int, num_groups: int, *, timeout_ms: int = 10_000,
        filtered_lease_ids: Sequence[str] = (), train_version: int | None = None,
    ) -> coordinator_pb2.FetchBatchResponse: ...

    async def commit_version(
        self, trainer_id: str, weights: common_pb2.WeightsRef
    ) -> coordinator_pb2.CommitVersionResponse: ...

    async def report_checkpoint(self, trainer_id: str, step: int, policy_version: int, path: str) -> None: ...

    async def resume_trainer(self, trainer_id: str, checkpoint_step: int) -> coordinator_pb2.ResumeTrainerResponse: ...


@dataclass(frozen=True)
class Algorithm:
    """The RL math (services.trainer.algos in production)."""

    compute_advantages: Callable[[SequenceBatch], torch.Tensor]
    """batch -> [B, L] advantages (reads seq_tensors reward and group_index)."""
    loss_fn: LossFn
    """Reads tensors advantages, old_logprobs, rollout_logprobs (and ref_logprobs)."""
    keep: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """DAPO dynamic sampling: (per-sequence values, group_index) -> bool mask; None: keep all."""
    values: Callable[[Mapping[str, torch.Tensor]], torch.Tensor] | None = None
    """Per-sequence values the DAPO filter compares, from a fetch's per-sequence tensors
    (convert.sequence_tensors); None: algos.dynamic_sampling_values with the metric."""
    correct: Callable[[SequenceBatch], dict[str, float]] | None = None
    """Decoupled mode: behaviour correction applied in place to the whole step batch once old
    logprobs are in (IS weights, rejection mask); returns metrics."""
    reward_kl: Callable[[SequenceBatch], dict[str, float]] | None = None
    """`algorithm.use_kl_in_reward`: writes the per-token KL penalty into the whole step batch once
    the old and reference logprobs are in (set, the loop computes the reference logprobs), before
    `correct` (verl's order); returns metrics."""


@dataclass(frozen=True)
class LoopSettings:
    """What the loop needs from the config (built by services.trainer.factory)."""

    trainer_id: str
    groups_per_step: int
    """required_samples = ppo_mini_batch_size * require_batches prompt groups per local step."""
    checkpoint_dir: Path
    mini_batches_per_step: int = 1
    ppo_epochs: int = 1
    shuffle: bool = False
    trigger_parameter_sync_step: int = 1
    total_steps: int = 0
    """Local steps of the run; <= 0: until the coordinator reports the data exhausted."""
    save_freq: int = -1
    temperature: float = 1.0
    bypass_mode: bool = True
    use_kl_loss: bool = False
    filter_metric: str = "acc"
    max_num_gen_batches: int = 0
    bucket_bytes: int = 2048 << 20
    fetch_timeout_ms: int = 5_000
    pad_token_id: int = 0
    max_checkpoints_to_keep: int | None = None
    metrics_path: Path | None = None
    resume_mode: str = "auto"
    resume_from_path: str | None = None
    session: str = ""
    """The run session (`meshrl train`'s, or the generated serve config's): a start with
    resume_mode=disable goes back to step 0 once per session (its restarts go on)."""
    seed: int = 42
    hf_export_dir: Path | None = None
    """Where the final policy is written as a Hugging Face checkpoint when the run ends; None: not."""
    coordinator_wait_s: float = 600.0
    """How long ResumeTrainer is retried while the coordinator is not up yet (unreachable, or its
    Serve application not deployed yet), and any call while a service is replaced (retry.py);
    0: fail at once."""
    overlap: bool = False
    """Fetch the next step's groups and publish the last version while the group trains (see the
    module docstring); False: every step fetches, trains and publishes in turn."""
    vocab_size: int | None = None
    """The policy's vocabulary size: a token id at or above it fails the step (None: unchecked)."""


@dataclass
class _Collected:
    groups: list[common_pb2.TrajectoryGroup] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    filtered: int = 0
    fetches: int = 0
    wait_s: float = 0.0
    exhausted: bool = False
    stop: bool = False


class TrainerLoop:
    """See the module docstring. `run()` is the whole life of the trainer; `status()` and
    `request_checkpoint()` may be called concurrently from the same event loop."""

    def __init__(
        self,
        settings: LoopSettings,
        group: TrainGroup,
        coordinator: CoordinatorLike,
        publisher: WeightPublisher | RankZeroPublisher,
        algorithm: Algorithm,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.s = settings
        self.group = group
        self.coordinator = coordinator
        self.publisher = publisher
        self.algorithm = algorithm
        self.clock = clock
        self.step = 0
        self.policy_version = 0
        self.last_checkpoint_step = -1
        self.last_checkpoint_path = ""
        self.pending_filtered: list[str] = []
        self.state = "created"
        self.error: str | None = None
        self.last_metrics: dict[str, float] = {}
        self.tokens_trained = 0
        """Tokens trained on (x ppo_epochs) since this loop started (its Prometheus counter)."""
        self._since_publish = 0
        self._checkpoint_s: float | None = None  # the last step-end checkpoint's seconds, for the next row
        self._ckpt_waiters: list[asyncio.Future[tuple[int, str]]] = []
        self.weights_version = 0
        """Version of the group's weights: policy_version, or the version being published."""
        self._publishing: asyncio.Task[float] | None = None
        self._publish_error: BaseException | None = None  # the last publish failure `_settle_publish` raised
        self._prefetch: tuple[int, asyncio.Task[tuple[coordinator_pb2.FetchBatchResponse, float]]] | None = None
        self._training: asyncio.Future[list[StepResult]] | None = None
        """The optimizer steps in flight while a publish settles (overlap): a re-export waits for them."""
        self.failed_broadcasts = 0
        """Collective broadcasts that failed after their version was made current (_broadcast_failed)."""
        self._failed_in_a_row = 0

    # ---- public ------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            self.state = "starting"
            await self._resume()
            self.state = "training"
            while await self._step_once():
                pass
            await self._finish()
            self.state = "finished"
            for fut in self._ckpt_waiters:  # a run that ended before its first step has no checkpoint
                if not fut.done():
                    fut.set_exception(FailedPrecondition("the trainer finished and has no checkpoint"))
            self._ckpt_waiters = []
            log.info("trainer_finished", step=self.step, policy_version=self.policy_version)
        except BaseException as exc:
            self.state = "failed"
            self.error = first_cause(exc)
            await self._cancel_background()
            for fut in self._ckpt_waiters:
                if not fut.done():
                    fut.set_exception(FailedPrecondition(f"trainer stopped before checkpointing: {self.error}"))
            raise

    def request_checkpoint(self) -> asyncio.Future[tuple[int, str]]:
        """A checkpoint at the next step boundary; resolves to (step, path)."""
        fut: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        if self.state in ("finished", "failed"):
            if self.last_checkpoint_step >= 0:
                fut.set_result((self.last_checkpoint_step, self.last_checkpoint_path))
            else:
                fut.set_exception(FailedPrecondition(f"the trainer is {self.state} and has no checkpoint"))
            return fut
        self._ckpt_waiters.append(fut)
        return fut

    def status(self) -> trainer_pb2.GetTrainerStatusResponse:
        """The loop's side of GetTrainerStatus (the servicer adds the engine name)."""
        return trainer_pb2.GetTrainerStatusResponse(
            trainer_id=self.s.trainer_id, state=self.state, step=self.step, policy_version=self.policy_version,
            optimizer_steps=self.group.step, world_size=self.group.world_size,
            last_checkpoint_step=max(0, self.last_checkpoint_step), error=self.error or "",
            metrics={k: float(v) for k, v in self.last_metrics.items()}, tokens_trained=self.tokens_trained,
        )

    # ---- start / finish ------------------------------------------------------------------------

    async def _resume(self) -> None:
        root = self.s.checkpoint_dir
        path: Path | None = None
        going_back = False  # to resume_from_path's step, or (disable) to 0: later checkpoints are set aside
        if self.s.resume_mode == "auto":
            path = checkpoints.newest(root)
        elif self.s.resume_mode == "resume_path":
            assert self.s.resume_from_path is not None
            path = Path(self.s.resume_from_path)
            done = checkpoints.resumed_from(root)
            if done is not None and checkpoints.names_resume_path(done.path, path):
                # a restart after the rollback (Serve restarting a crashed replica): this line's
                # newest checkpoint past it, never the path again (it would undo what trained since)
                newer = checkpoints.newest(root)
                if newer is not None and checkpoints.read_state(newer).step > done.step:
                    path = newer
            else:
                going_back = True
        else:
            # disable: back to step 0 once per run session; a restart in the same session (Serve
            # restarting a crashed replica) goes on from this line's newest checkpoint, never
            # back to 0 again (that set aside everything trained and republished the initial weights)
            done = checkpoints.resumed_from(root)
            if self.s.session and done is not None and done.path == "" and done.session == self.s.session:
                path = checkpoints.newest(root)
            else:
                going_back = True
        state: checkpoints.LoopState | None = None
        if path is not None:
            state = checkpoints.read_state(path)
            await self.group.load_checkpoint(path)
            if self.group.step != state.optimizer_steps:
                raise FailedPrecondition(
                    f"checkpoint {path} restored {self.group.step} optimizer steps but its state says "
                    f"{state.optimizer_steps}; the checkpoint is inconsistent"
                )
            self.step = state.step
            self.pending_filtered = list(state.pending_filtered)
            self.last_checkpoint_step, self.last_checkpoint_path = state.step, str(path)
            log.info("trainer_resumed_from_checkpoint", path=str(path), step=self.step)
        if going_back:
            aside = checkpoints.set_aside_after(root, self.step)
            if aside:
                log.warning("checkpoints_set_aside", step=self.step, resume_mode=self.s.resume_mode,
                            paths=[str(p) for p in aside], hint="a later line of training than this start's: kept, "
                            "never resumed from or rotated")
        if self.s.resume_mode == "auto":
            checkpoints.record_resumed_from(root, None)  # a later resume_path / disable start goes back again
        elif going_back:
            checkpoints.record_resumed_from(
                root, checkpoints.ResumedFrom(str(path) if path is not None else "", self.step, self.s.session))
        resp = await self._resume_trainer()
        self.policy_version = self.weights_version = resp.policy_version
        if path is not None and state is not None:
            # A trainer that died between committing this checkpoint and reporting it resumes from
            # it: reported now (a repeat is a no-op), else its groups stay delivered for good.
            version = min(state.policy_version, resp.policy_version)
            await retry_transient(
                "ReportCheckpoint", lambda: self.coordinator.report_checkpoint(self.s.trainer_id, self.step, version, str(path)),
                wait_s=self.s.coordinator_wait_s,
            )
        log.info("trainer_started", step=self.step, policy_version=self.policy_version, requeued=resp.requeued)
        if path is not None or resp.policy_version > 0:
            await self._publish()  # rollouts move to the weights training continues from
        elif not self.s.bypass_mode:
            await self.group.snapshot_proximal()

    async def _resume_trainer(self) -> coordinator_pb2.ResumeTrainerResponse:
        """ResumeTrainer, retried with backoff while the coordinator is not up: the apps of one
        `serve deploy` start together, and the gRPC ingress answers NOT_FOUND for an application
        not deployed yet (UNAVAILABLE before a proxy listens, DEADLINE_EXCEEDED while it starts)."""
        deadline = time.monotonic() + self.s.coordinator_wait_s
        delay = 0.5
        while True:
            try:
                return await self.coordinator.resume_trainer(self.s.trainer_id, self.step)
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                if code not in _NOT_UP_YET or time.monotonic() + delay > deadline:
                    raise
                log.warning("coordinator_not_up_yet", code=code.name, retry_in_s=delay,
                            hint="waiting for the coordinator (trainer_service.coordinator_wait_s)")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _finish(self) -> None:
        await self._settle_publish()
        if self._since_publish > 0:
            await self._publish()
        if self.step > 0 and self.last_checkpoint_step != self.step:
            await self._checkpoint()
        self._serve_checkpoint_waiters()
        if self.s.hf_export_dir is not None and self.step > 0:
            await self.group.save_hf(self.s.hf_export_dir)
            log.info("hf_exported", path=str(self.s.hf_export_dir), step=self.step)

    # ---- one step ------------------------------------------------------------------------------

    async def _step_once(self) -> bool:
        if self.s.total_steps > 0 and self.step >= self.s.total_steps:
            return False
        t0 = self.clock()
        got = await self._collect(self.step + 1)
        if got.stop:
            await self._settle_publish()
            if self.last_checkpoint_step != self.step:
                await self._checkpoint()
            self._serve_checkpoint_waiters()
            log.info("trainer_stop_requested", step=self.step)
            return False
        if not got.groups:
            return False
        t1 = self.clock()
        batch = groups_to_batch(got.groups, self.s.pad_token_id)
        check_batch(batch, self.s.vocab_size)
        timing: dict[str, float] = {}
        at_version = version_mask(token_versions(got.groups), (batch.num_seqs, int(batch.input_ids.shape[1])), self.weights_version)
        t = self.clock()
        if self.s.bypass_mode:
            batch.tensors["old_logprobs"] = batch.tensors["rollout_logprobs"]
            if self._since_publish == 0:
                # the loss splits the mismatch (first mini-batch); later in a sync window the
                # weights moved past the published version: no token is at them
                batch.tensors[VERSION_MASK_KEY] = at_version
        else:
            # at the first step of a window the current parameters are the proximal ones
            old, _ = await self.group.compute_logprobs(
                batch, temperature=self.s.temperature, proximal=self._since_publish > 0
            )
            batch.tensors["old_logprobs"] = old
            timing["timing_s/old_log_prob"] = self.clock() - t  # verl's name
            timing.update(split_metrics(old, batch.tensors["rollout_logprobs"], batch.response_mask, at_version))
        if self.s.use_kl_loss or self.algorithm.reward_kl is not None:
            t = self.clock()
            ref, _ = await self.group.compute_logprobs(batch, temperature=self.s.temperature, reference=True)
            batch.tensors["ref_logprobs"] = ref
            timing["timing_s/ref"] = self.clock() - t
        # verl's order: the KL in the reward (on the whole response), then the correction (which
        # may reject tokens), then the advantages over what is left
        correction: dict[str, float] = {}
        if self.algorithm.reward_kl is not None:
            correction.update(self.algorithm.reward_kl(batch))
        if not self.s.bypass_mode and self.algorithm.correct is not None:
            correction.update(self.algorithm.correct(batch))
        batch.tensors["advantages"] = self.algorithm.compute_advantages(batch).float() * batch.response_mask
        t = self.clock()
        if self.s.overlap:
            results, blocked = await self._update_overlapped(batch, got)
            timing["timing_s/update_actor"] = self.clock() - t - blocked
        else:
            results = await self._update(batch)
            timing["timing_s/update_actor"] = self.clock() - t
            blocked = 0.0
        self.step += 1
        self._since_publish += 1
        if self._since_publish >= self.s.trigger_parameter_sync_step:
            t = self.clock()
            if self.s.overlap:
                await self._begin_publish()
            else:
                await self._publish()
            timing["timing_s/publish"] = self.clock() - t + blocked
        elif blocked:
            timing["timing_s/publish"] = blocked
        if self._checkpoint_s is not None:  # the checkpoint after the step before (see below)
            timing["timing_s/last_checkpoint"], self._checkpoint_s = self._checkpoint_s, None
        end = self.clock()
        # The step's metrics row is written before its checkpoint is committed: a trainer lost
        # between the two would resume after a step that has no row.
        self._record(batch, got, results, {**correction, **timing}, wait_s=got.wait_s, train_s=end - t1, step_s=end - t0)
        if self.s.save_freq > 0 and self.step % self.s.save_freq == 0:
            t = self.clock()
            await self._checkpoint()
            self._checkpoint_s = self.clock() - t  # reported in the next step's row
        return not got.exhausted

    async def _update_overlapped(self, batch: SequenceBatch, got: _Collected) -> tuple[list[StepResult], float]:
        """`_update` while the version in flight commits and then the next step's groups are
        fetched. Returns the results and the seconds the loop still waited on the publish once
        training had ended."""
        train = self._training = asyncio.ensure_future(self._update(batch))
        ended: list[float] = []
        train.add_done_callback(lambda _: ended.append(self.clock()))
        try:
            await self._settle_publish()
            settled = self.clock()
            publishes = self._since_publish + 1 >= self.s.trigger_parameter_sync_step
            next_step = self.step + 2
            last = self.s.total_steps > 0 and next_step > self.s.total_steps
            if not (got.exhausted or last or self._ckpt_waiters):
                version = self.weights_version + (1 if publishes else 0)
                task = asyncio.ensure_future(self._fetch(next_step, self.s.groups_per_step, version))
                self._prefetch = (next_step, task)
            results = await train
        except BaseException:
            train.cancel()
            raise
        return results, max(0.0, settled - ended[0]) if ended else 0.0

    async def _fetch(
        self, step: int, need: int, train_version: int | None
    ) -> tuple[coordinator_pb2.FetchBatchResponse, float]:
        """One FetchBatch (sending the filtered groups not reported yet); returns it and its wait."""
        t = self.clock()
        filtered, self.pending_filtered = self.pending_filtered, []
        resp = await self.coordinator.fetch_batch(
            self.s.trainer_id, step, need, timeout_ms=self.s.fetch_timeout_ms, filtered_lease_ids=filtered,
            train_version=train_version,
        )
        return resp, self.clock() - t

    async def _collect(self, step: int) -> _Collected:
        """Fetch until `groups_per_step` groups are kept (fewer only at the end of the data). A
        FetchBatch that failed transiently (the coordinator restarting) may have delivered groups
        whose answer was lost: re-sync (retry.py) and collect the step again from scratch."""
        while True:
            filtered = list(self.pending_filtered)
            try:
                return await self._collect_once(step)
            except Exception as exc:
                if not transient(exc) or exc is self._publish_error:
                    raise
                # Groups filtered in this collection go back to the queue with the others; those of
                # earlier steps are reported again (a repeat is ignored).
                self.pending_filtered = filtered
                await self._resync(step - 1, exc)

    async def _resync(self, trained_step: int, error: BaseException) -> None:
        """ResumeTrainer(trained_step): every group delivered for a later step goes back to the head
        of the queue in order (none of them was trained), so a lost FetchBatch answer loses nothing."""
        resp = await retry_transient(
            "ResumeTrainer", lambda: self.coordinator.resume_trainer(self.s.trainer_id, trained_step),
            wait_s=self.s.coordinator_wait_s, first_error=error,
        )
        log.warning("fetch_resynced", step=trained_step + 1, requeued=resp.requeued, error=first_cause(error))

    async def _collect_once(self, step: int) -> _Collected:
        out = _Collected()
        need = self.s.groups_per_step
        productive = 0
        prefetched = None
        if self._prefetch is not None:
            pstep, task = self._prefetch
            self._prefetch = None
            assert pstep == step, f"groups fetched ahead for step {pstep}, but step {step} is next"
            prefetched = task
        while len(out.groups) < need:
            if self._ckpt_waiters:
                await self._checkpoint()
            if prefetched is not None:
                t = self.clock()
                resp, _ = await prefetched
                prefetched = None
                out.wait_s += self.clock() - t
            else:
                resp, waited = await self._fetch(
                    step, need - len(out.groups), self.weights_version if self.s.overlap else None
                )
                out.wait_s += waited
            out.fetches += 1
            groups, staleness = list(resp.groups), list(resp.staleness)
            if groups:
                productive += 1
                keep = self._keep(groups)
                for g, s, k in zip(groups, staleness, keep, strict=True):
                    if k:
                        out.groups.append(g)
                        out.staleness.append(s)
                    else:
                        self.pending_filtered.append(g.lease_id)
                        out.filtered += 1
            if resp.checkpoint_requested and self.last_checkpoint_step != self.step:
                await self._checkpoint()
            if resp.stop_requested:
                out.stop = True
                return out
            if resp.exhausted:
                if self.pending_filtered:
                    # the groups this fetch filtered are reported by one more (nothing is left to
                    # deliver: it answers at once), else the final checkpoint has them consumed
                    continue
                out.exhausted = True
                return out
            if not groups:
                await self._send_again_if_wanted()
            limit = self.s.max_num_gen_batches
            if self.algorithm.keep is not None and limit > 0 and productive >= limit and len(out.groups) < need:
                raise FailedPrecondition(
                    f"dynamic sampling kept {len(out.groups)}/{need} groups after {productive} fetches "
                    f"(algorithm.filter_groups.max_num_gen_batches={limit}); the data gives too many zero-variance "
                    "groups: check the reward, raise max_num_gen_batches, or set it to 0 (no limit)"
                )
        return out

    def _keep(self, groups: list[common_pb2.TrajectoryGroup]) -> list[bool]:
        if self.algorithm.keep is None:
            return [True] * len(groups)
        seq = sequence_tensors(groups)  # the per-sequence values only: a dropped group is never tensorized
        gi = seq["group_index"]
        values = self.algorithm.values(seq) if self.algorithm.values else dynamic_sampling_values(seq, self.s.filter_metric)
        mask = self.algorithm.keep(values, gi).bool()
        if mask.numel() == len(groups):
            return [bool(x) for x in mask.tolist()]
        assert mask.numel() == gi.numel(), "dynamic_sampling_keep must return one flag per sequence or per group"
        whole = torch.ones(len(groups), dtype=torch.long).scatter_reduce(0, gi, mask.long(), "amin")
        return [bool(x) for x in whole.tolist()]

    async def _update(self, batch: SequenceBatch) -> list[StepResult]:
        """require_batches mini-batches (whole groups each) x ppo_epochs optimizer steps."""
        gi = batch.seq_tensors["group_index"]
        n_groups = int(gi.max().item()) + 1
        results: list[StepResult] = []
        rng = random.Random(self.s.seed * 1_000_003 + self.step)
        for _ in range(self.s.ppo_epochs):
            order = list(range(n_groups))
            if self.s.shuffle:
                rng.shuffle(order)
            k = max(1, min(self.s.mini_batches_per_step, n_groups))
            for part in range(k):
                chosen = set(order[part * n_groups // k : (part + 1) * n_groups // k])
                idx = [i for i in range(batch.num_seqs) if int(gi[i]) in chosen]
                mini = batch.select(idx)
                if results:  # after an optimizer step no token is at the trainer's weights
                    mini.tensors.pop(VERSION_MASK_KEY, None)
                results.append(await self.group.train(mini, self.algorithm.loss_fn, temperature=self.s.temperature))
        return [dataclasses.replace(r, metrics=finish_loss_sums(r.metrics)) for r in results]

    # ---- weights and checkpoints -------------------------------------------------------------

    async def _publish(self) -> None:
        await self._begin_publish()
        await self._settle_publish()

    async def _begin_publish(self) -> None:
        """Export the group's weights as version policy_version + 1 and publish and commit them in
        the background (`_settle_publish` waits). The export is ordered before any later group
        call, so training may go on meanwhile."""
        await self._settle_publish()
        version = self.policy_version + 1
        published: Awaitable[common_pb2.WeightsRef]
        if isinstance(self.publisher, RankZeroPublisher):
            published = self.group.publish_weights(version, self.s.bucket_bytes)
        else:
            published = self.publisher.publish(version, self.group.export_weights(self.s.bucket_bytes))
        self.weights_version = version
        self._since_publish = 0
        self._publishing = asyncio.ensure_future(self._publish_and_commit(version, published))
        if not self.s.bypass_mode:
            await self.group.snapshot_proximal()

    async def _publish_and_commit(self, version: int, published: Awaitable[common_pb2.WeightsRef]) -> float:
        t = self.clock()
        while True:
            try:
                ref = await published
                break
            except Exception as exc:
                if isinstance(self.publisher, RankZeroPublisher):
                    if not self._broadcast_failed(version, exc, self.clock() - t):
                        return self.clock() - t
                    published = self.group.publish_weights(version, self.s.bucket_bytes)
                    continue
                if not transient(exc):
                    raise
                ref = await self._republish(version, exc)
                break
        self._failed_in_a_row = 0
        if ref.policy_version != version:
            raise FailedPrecondition(f"publisher returned version {ref.policy_version} for {version}")
        resp = await retry_transient(
            "CommitVersion", lambda: self.coordinator.commit_version(self.s.trainer_id, ref),
            wait_s=self.s.coordinator_wait_s,
        )
        self.policy_version = resp.policy_version
        seconds = self.clock() - t
        log.info("weights_published", policy_version=version, bytes=ref.total_bytes, seconds=round(seconds, 3))
        return seconds

    def _broadcast_failed(self, version: int, exc: Exception, seconds: float) -> bool:
        """A collective broadcast that failed after its CommitVersion made the version current.
        Returns whether to send the version again: a peer that left or stalled mid-broadcast
        (UNAVAILABLE, DEADLINE_EXCEEDED) aborted it for every receiver, so no rollout rank may hold
        it, none leases prompts until it does, and no groups come to train a next version on
        (with one rollout replica, its replacement asked the group for this version and the run
        stood still); sent again, the group re-forms with whoever checks in, the replacement
        included. Otherwise (a bucket failed its checksum max_fetch_attempts times, a
        receiver on another version) the ranks that got it whole load it, the others keep their
        weights and load the next version. Anything else, or MAX_FAILED_BROADCASTS_IN_A_ROW
        failures, stops the loop."""
        cause = root_cause(exc)
        if not (isinstance(cause, MeshError) and cause.code in _BROADCAST_FAILURES
                and getattr(cause, "announced_version", None) == version):
            raise exc
        self.failed_broadcasts += 1
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= MAX_FAILED_BROADCASTS_IN_A_ROW:
            raise FailedPrecondition(
                f"the last {self._failed_in_a_row} weight broadcasts (up to version {version}) all failed "
                f"(the last: {first_cause(exc)}); check the rollout ranks of the collective group"
            ) from exc
        self.policy_version = version
        again = cause.code in _SEND_AGAIN
        log.warning("weights_broadcast_failed", policy_version=version, seconds=round(seconds, 3),
                    failed_in_a_row=self._failed_in_a_row, error=first_cause(exc), sent_again=again,
                    hint="the version is current; sent again" if again else
                    "the version is current; rollout ranks that missed it load the next one")
        return again

    async def _send_again_if_wanted(self) -> None:
        """A collective transport's version that went through, then its receiver died (a single
        rollout replica killed right after loading it): the replacement takes the dead one's
        place in the group and asks for that version, which only this sender holds, and with no
        rollout generating there are no groups to train a next version on (the run stood still).
        Asked after a FetchBatch that brought no groups, with no publish in flight: the param
        server says whether every receiver waits for it in a generation the sender has not joined
        (RankZeroPublisher.wanted_again); it then goes again, or, if the weights were trained on
        since, they go as the next version."""
        probe = self.publisher.wanted_again if isinstance(self.publisher, RankZeroPublisher) else None
        if probe is None or (self._publishing is not None and not self._publishing.done()):
            return
        await self._settle_publish()
        version = self.policy_version
        try:
            wanted = await probe(version)
        except (MeshError, OSError) as exc:  # the param server restarting: asked again after the next fetch
            log.info("send_again_probe_failed", policy_version=version, error=first_cause(exc))
            return
        if not wanted:
            return
        log.warning("weights_sent_again", policy_version=version, trained_since=self._since_publish,
                    hint="every rollout rank of the collective group waits for the current version (one that "
                    "held it was replaced)" + ("; the weights trained since go as the next version" if self._since_publish else ""))
        if self._since_publish > 0:
            await self._begin_publish()
            return
        published = self.group.publish_weights(version, self.s.bucket_bytes)
        self._publishing = asyncio.ensure_future(self._publish_and_commit(version, published))

    async def _republish(self, version: int, error: BaseException) -> common_pb2.WeightsRef:
        """The param server went away during the upload (Serve replaces it, empty): publish
        `version` again to the replacement, from the group's weights once the steps in flight are
        done (with the overlap, one step newer than the first export: never older)."""
        publisher = self.publisher
        assert not isinstance(publisher, RankZeroPublisher)

        async def steps_done() -> None:
            if self._training is not None:
                await asyncio.wait([self._training])

        return await retry_transient(
            f"publish of version {version}", lambda: publisher.publish(version, self.group.export_weights(self.s.bucket_bytes)),
            wait_s=self.s.coordinator_wait_s, first_error=error, before=steps_done,
        )

    async def _settle_publish(self) -> None:
        """Wait for the publish in flight, if any (its failure fails the loop: `_collect`, which
        settles it before a checkpoint or a send-again probe, must not take a transient one for a
        lost FetchBatch answer)."""
        task, self._publishing = self._publishing, None
        if task is not None:
            try:
                await task
            except Exception as exc:
                self._publish_error = exc
                raise

    async def _cancel_background(self) -> None:
        tasks = [t for t in (self._publishing, self._prefetch[1] if self._prefetch else None) if t is not None]
        self._publishing, self._prefetch = None, None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _checkpoint(self) -> None:
        await self._settle_publish()
        step = self.step
        root = self.s.checkpoint_dir
        if step == self.last_checkpoint_step and Path(self.last_checkpoint_path).is_dir():
            # Nothing trained since (a SaveCheckpoint right after a periodic save, or after a
            # resume): the checkpoint there is this one, rewriting it would only risk it.
            self._serve_checkpoint_waiters()
            return
        tmp = checkpoints.begin(root, step)
        await self.group.save_checkpoint(tmp)
        state = checkpoints.LoopState(step, self.policy_version, self.group.step, list(self.pending_filtered))
        final = checkpoints.commit(root, step, state)
        await retry_transient(
            "ReportCheckpoint",
            lambda: self.coordinator.report_checkpoint(self.s.trainer_id, step, self.policy_version, str(final)),
            wait_s=self.s.coordinator_wait_s,
        )
        self.last_checkpoint_step, self.last_checkpoint_path = step, str(final)
        removed = checkpoints.rotate(root, self.s.max_checkpoints_to_keep, protect=final)
        log.info("checkpoint_saved", step=step, path=str(final), removed=[p.name for p in removed])
        self._serve_checkpoint_waiters()

    def _serve_checkpoint_waiters(self) -> None:
        if self.last_checkpoint_step < 0:
            return
        waiters, self._ckpt_waiters = self._ckpt_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result((self.last_checkpoint_step, self.last_checkpoint_path))

    # ---- metrics -------------------------------------------------------------------------------

    def _record(
        self, batch: SequenceBatch, got: _Collected, results: list[StepResult], timing: dict[str, float],
        *, wait_s: float, train_s: float, step_s: float,
    ) -> None:
        m: dict[str, float] = {}
        keys = {k for r in results for k in r.metrics}
        for k in sorted(keys):
            vals = [r.metrics[k] for r in results if k in r.metrics]
            m[k] = sum(vals) / len(vals)
        m["actor/grad_norm"] = sum(r.grad_norm for r in results) / len(results)
        m["actor/lr"] = results[-1].lr
        mask = batch.response_mask
        tokens = int(batch.attention_mask.sum().item()) * self.s.ppo_epochs
        self.tokens_trained += tokens
        resp_len = batch.seq_tensors["response_length"]
        scores, rewards = batch.seq_tensors["reward"].float(), sequence_rewards(batch)
        # max/min over the response tokens only: the prompt and padding hold 0, not an advantage
        adv = batch.tensors["advantages"][mask.bool()]
        st = got.staleness
        m.update({
            "training/step": float(self.step),
            "training/policy_version": float(self.weights_version),
            "training/optimizer_steps": float(self.group.step),
            "training/groups": float(len(got.groups)),
            "training/sequences": float(batch.num_seqs),
            "training/filtered_groups": float(got.filtered),
            "training/fetches": float(got.fetches),
            "training/failed_broadcasts": float(self.failed_broadcasts),
            # verl: score = the reward as scored, rewards = it minus the KL penalty (use_kl_in_reward)
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "critic/rewards/mean": float(rewards.mean()),
            "critic/rewards/max": float(rewards.max()),
            "critic/rewards/min": float(rewards.min()),
            "critic/advantages/mean": float((batch.tensors["advantages"] * mask).sum() / mask.sum().clamp(min=1)),
            "critic/advantages/max": float(adv.max()) if adv.numel() else 0.0,
            "critic/advantages/min": float(adv.min()) if adv.numel() else 0.0,
            "response_length/mean": float(resp_len.mean()),
            "response_length/max": float(resp_len.max()),
            "response_length/min": float(resp_len.min()),
            "staleness/min": float(min(st)) if st else 0.0,
            "staleness/mean": float(sum(st) / len(st)) if st else 0.0,
            "staleness/max": float(max(st)) if st else 0.0,
            "perf/tokens": float(tokens),
            "perf/throughput_tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
            "perf/idle_ratio": wait_s / step_s if step_s > 0 else 0.0,
            "timing_s/wait_data": wait_s,
            "timing_s/step": step_s,
            **timing,
            **agent_metrics(batch),
        })
        # verl's fully async trainer logs these two under its own names; the same numbers there
        # too, so its dashboards and scripts find them (perf/idle_ratio and timing_s/publish stay:
        # the report, the progress line and the Prometheus gauges read them)
        m["trainer/idle_ratio"] = m["perf/idle_ratio"]
        if "timing_s/publish" in m:
            m["timing_s/param_sync"] = m["timing_s/publish"]
        if "prompt_length" in batch.seq_tensors:
            plen = batch.seq_tensors["prompt_length"]
            m.update({"prompt_length/mean": float(plen.mean()), "prompt_length/max": float(plen.max()),
                      "prompt_length/min": float(plen.min())})
        if "finish_length" in batch.seq_tensors:
            # verl's share of responses cut at max_response_length (it compares the length with the
            # limit; a cut response says so in its finish_reason, which also covers a multi-turn
            # trajectory that ran out of its budget)
            m["response_length/clip_ratio"] = float(batch.seq_tensors["finish_length"].mean())
        if not self.s.bypass_mode:
            m["rollout_corr/mismatch_kl_k3"] = mismatch_k3(
                batch.tensors["old_logprobs"], batch.tensors["rollout_logprobs"], mask)
        self.last_metrics = m
        if self.s.metrics_path is not None:
            self.s.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            record = {k: (v if math.isfinite(v) else None) for k, v in m.items()}
            with self.s.metrics_path.open("a") as f:
                f.write(json.dumps({"step": self.step, "time": time.time(), **record}) + "\n")
        log.info("train_step", step=self.step, policy_version=self.weights_version,
                 grad_norm=round(m["actor/grad_norm"], 4), reward=round(m["critic/rewards/mean"], 4),
                 idle_ratio=round(m["perf/idle_ratio"], 3))

