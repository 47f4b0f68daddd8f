"""Hand-written fakes for the trainer loop tests: the coordinator's trainer side (a queue of
groups, versions, checkpoints, operator flags) and a small, real policy-gradient algorithm."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.v1 import common_pb2, coordinator_pb2
from services.common.errors import FailedPrecondition
from services.trainer.core import Algorithm
from services.trainer.engines.base import ForwardOutput, LossScale, SequenceBatch


def make_group(
    lease_id: str, rewards: Sequence[float], *, version: int = 0, prompt: Sequence[int] = (7, 8, 9, 10),
    response_len: int = 6, seed: int = 0,
) -> common_pb2.TrajectoryGroup:
    g = torch.Generator().manual_seed(seed)
    group = common_pb2.TrajectoryGroup(
        lease_id=lease_id, prompt_token_ids=list(prompt), min_policy_version=version, max_policy_version=version,
    )
    for i, reward in enumerate(rewards):
        n = response_len - (i % 2)
        tokens = torch.randint(10, 90, (n,), generator=g).tolist()
        group.responses.add(
            sample_index=i, token_ids=tokens, logprobs=[-2.5] * n, versions=[version] * n, reward=reward,
            reward_metrics={"acc": float(reward > 0)},
        )
    return group


@dataclass
class FakeCoordinator:
    """Groups are queued by the test; fetch hands them out in order with staleness = current
    version - group min version. `finite`: report `exhausted` once the queue is empty."""

    queue: deque[common_pb2.TrajectoryGroup] = field(default_factory=deque)
    policy_version: int = 0
    finite: bool = True
    checkpoint_requested: bool = False
    stop_requested: bool = False
    fetches: list[dict[str, Any]] = field(default_factory=list)
    commits: list[common_pb2.WeightsRef] = field(default_factory=list)
    checkpoints: list[tuple[int, int, str]] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)
    delivered: dict[str, int] = field(default_factory=dict)

    async def fetch_batch(
        self, trainer_id: str, step: int, num_groups: int, *, timeout_ms: int = 10_000,
        filtered_lease_ids: Sequence[str] = (), train_version: int | None = None,
    ) -> coordinator_pb2.FetchBatchResponse:
        self.fetches.append({"step": step, "num_groups": num_groups, "filtered": list(filtered_lease_ids),
                             "train_version": train_version})
        version = self.policy_version if train_version is None else train_version
        if not self.policy_version <= version <= self.policy_version + 1:
            raise FailedPrecondition(f"train_version {version} with version {self.policy_version} committed")
        if not self.queue:
            await asyncio.sleep(0.01)  # a real FetchBatch waits for groups; never spin the event loop
        resp = coordinator_pb2.FetchBatchResponse(policy_version=self.policy_version)
        while self.queue and len(resp.groups) < num_groups and not self.stop_requested:
            g = self.queue.popleft()
            resp.groups.append(g)
            resp.staleness.append(version - g.min_policy_version)
            self.delivered[g.lease_id] = step
        resp.exhausted = self.finite and not self.queue
        resp.checkpoint_requested = self.checkpoint_requested
        resp.stop_requested = self.stop_requested
        return resp

    async def commit_version(self, trainer_id: str, weights: common_pb2.WeightsRef) -> coordinator_pb2.CommitVersionResponse:
        # as the coordinator: re-committing the current version with the same weights is a no-op
        if self.commits and weights.policy_version == self.policy_version and weights == self.commits[-1]:
            return coordinator_pb2.CommitVersionResponse(policy_version=self.policy_version)
        if weights.policy_version != self.policy_version + 1:
            raise FailedPrecondition(f"expected {self.policy_version + 1}, got {weights.policy_version}")
        self.policy_version = weights.policy_version
        self.commits.append(weights)
        return coordinator_pb2.CommitVersionResponse(policy_version=self.policy_version)

    async def report_checkpoint(self, trainer_id: str, step: int, policy_version: int, path: str) -> None:
        # the coordinator's rule: a checkpoint holds no groups fetched for an uncommitted version
        ahead = [f for f in self.fetches if f["step"] <= step and (f["train_version"] or 0) > self.policy_version]
        if ahead:
            raise FailedPrecondition(f"step {ahead[0]['step']} fetched for version {ahead[0]['train_version']}, "
                                     f"{self.policy_version} committed")
        self.checkpoints.append((step, policy_version, path))
        self.checkpoint_requested = False

    async def resume_trainer(self, trainer_id: str, checkpoint_step: int) -> coordinator_pb2.ResumeTrainerResponse:
        self.resumes.append(checkpoint_step)
        return coordinator_pb2.ResumeTrainerResponse(requeued=0, policy_version=self.policy_version)


def group_mean_advantages(batch: SequenceBatch) -> torch.Tensor:
    """reward - group mean, broadcast over response tokens."""
    r, gi = batch.seq_tensors["reward"], batch.seq_tensors["group_index"]
    means = torch.zeros(int(gi.max()) + 1).index_add_(0, gi, r) / torch.bincount(gi).float()
    return (r - means[gi])[:, None] * batch.response_mask


@dataclass
class RecordingLoss:
    """Policy gradient with the importance ratio to old_logprobs; records what it was given."""

    seen: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def __call__(self, out: ForwardOutput, mb: SequenceBatch, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
        self.seen.append({k: v.clone() for k, v in mb.tensors.items()})
        ratio = torch.exp(out.logprobs - mb.tensors["old_logprobs"]) * mb.response_mask
        loss = -(ratio * mb.tensors["advantages"]).sum() / scale.num_tokens * scale.dp_size
        if "ref_logprobs" in mb.tensors:
            kl = ((out.logprobs - mb.tensors["ref_logprobs"]) * mb.response_mask).sum() / scale.num_tokens
            loss = loss + 0.1 * kl * scale.dp_size
        return loss, {"actor/pg_loss": float(loss.item())}


def keep_varied(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """DAPO: keep sequences of groups whose values are not all equal."""
    keep = torch.zeros_like(values, dtype=torch.bool)
    for g in group_index.unique():
        sel = group_index == g
        keep[sel] = bool(values[sel].max() > values[sel].min())
    return keep


def fake_algorithm(filter_groups: bool = False) -> tuple[Algorithm, RecordingLoss]:
    loss = RecordingLoss()
    return Algorithm(group_mean_advantages, loss, keep_varied if filter_groups else None), loss
