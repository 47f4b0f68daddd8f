"""`rollout_worker.*`: what a rollout replica's worker loop can be told. The engine's own knobs are
verl's `actor_rollout_ref.rollout.*`; partial rollout and concurrency are `async_training.*`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import ConfigModel


class RolloutWorkerConfig(ConfigModel):
    """The lease → generate → score → submit loop of one rollout replica."""

    coordinator_address: str | None = None
    """host:port of CoordinatorService; null: `coordinator.host:coordinator.port`."""
    coordinator_application: str | None = None
    """Serve application name sent as `application` metadata when the coordinator sits behind
    Serve's gRPC ingress with several applications; null: none sent."""
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    """Device of the transformers engine (for vLLM, which picks its platform itself, it decides
    whether sleep mode, `free_cache_engine`, is on: accelerators only); `auto` picks cuda, then npu,
    then cpu."""
    initial_policy_version: int = Field(default=0, ge=0)
    """Policy version of the weights the engine starts with (the checkpoint in
    actor_rollout_ref.model.path)."""
    lease_renew_interval_s: float | None = Field(default=None, gt=0)
    """Seconds between RenewLeases calls for in-flight groups (the replica's heartbeat); null:
    coordinator.replica_ttl_s / 4 (coordinator.lease_timeout_s / 3 without a replica TTL)."""
    idle_poll_s: float = Field(default=0.5, gt=0)
    """First wait before leasing again when no prompt was granted (doubles up to 8x)."""
    rpc_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of one coordinator call."""
    submit_max_retries: int = Field(default=10, ge=0)
    """Retries of a SubmitGroups call that failed with UNAVAILABLE / DEADLINE_EXCEEDED, or whose
    coordinator replica died under it (idempotent by lease id; backoff from 0.2 s doubling to 5 s:
    10 retries span ~30 s, a coordinator restart); after that the lease is given back (once the
    coordinator answers) and its prompt re-issued."""
    weight_load_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of one weight update (fetch + load); at least `param_server.transfer_timeout_s`
    (checked: a failed update is retried with the same deadline)."""
    reward_application: str | None = "reward"
    """Serve application of the reward service, called through a DeploymentHandle when the
    replica runs under Serve; null: use `reward_address`."""
    reward_address: str | None = None
    """host:port of a RewardService (Serve's gRPC ingress or a plain server) when not using the
    handle; with `reward_application` it is sent as `application` metadata."""
    fetch_weights_from_param_server: bool = True
    """Fetch new versions from the param server (param_server.host:port or advertise_address)
    with the group's transport; false: the replica never updates weights (validation only)."""
    batch_window_ms: float = Field(default=5.0, ge=0)
    """Groups finishing within this window share one SubmitGroups call and one reward Score call
    (fewer RPCs per group); 0: every group alone."""
    max_submit_batch: int = Field(default=64, ge=1)
    """Groups per SubmitGroups call."""
    max_score_batch: int = Field(default=512, ge=1)
    """Items per reward Score call."""
    autostart: bool = True
    """Start the lease loop when the replica starts; false: only the RolloutService RPCs
    (validation-only replicas)."""
