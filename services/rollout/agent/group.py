"""Trajectories -> the TrajectoryGroup the coordinator queues, and the reward a trajectory gets
(`environment.reward_source`)."""

from __future__ import annotations

from collections.abc import Sequence

from meshrl.v1 import common_pb2
from services.common.errors import FailedPrecondition

from .trajectory import Trajectory, to_response


def build_group(
    *,
    lease_id: str,
    prompt: common_pb2.Prompt,
    prompt_ids: Sequence[int],
    trajectories: Sequence[Trajectory],
    replica_id: str,
    fallback_version: int,
    generation_s: float,
) -> common_pb2.TrajectoryGroup:
    """min/max_policy_version span the policy tokens only (staleness counts the oldest)."""
    g = common_pb2.TrajectoryGroup(
        lease_id=lease_id, prompt=prompt, prompt_token_ids=list(prompt_ids), replica_id=replica_id,
        generation_s=generation_s,
    )
    versions = [v for t in trajectories for v in t.policy_versions()]
    g.min_policy_version = min(versions) if versions else fallback_version
    g.max_policy_version = max(versions) if versions else fallback_version
    g.responses.extend(to_response(t) for t in trajectories)
    return g


def apply_reward_source(group: common_pb2.TrajectoryGroup, source: str) -> None:
    """Set each response's reward from the environment's (after the reward service scored, if it
    did): `environment` replaces it, `sum` adds to it, `reward_service` only records it as metric
    `env_reward`. An environment that gave no reward where its reward is required fails the group
    (FailedPrecondition; an environment that rewards finished episodes only may leave one sample
    without: not the replica's own bad input, on which it would stop; an environment that never
    rewards fails every group, and the coordinator halts on a series of them with this reason)."""
    for r in group.responses:
        env = r.env_reward if r.HasField("env_reward") else None
        if source == "environment":
            if env is None:
                raise FailedPrecondition(
                    f"environment.reward_source is environment, but the environment gave no reward for "
                    f"{group.lease_id}/{r.sample_index}; have it reward Step/Close or use reward_service"
                )
            r.reward = env
        elif source == "sum":
            r.reward += env or 0.0
        if env is not None:
            r.reward_metrics["env_reward"] = env
