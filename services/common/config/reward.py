"""`reward.*`: the reward service and its external endpoints."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from .base import ConfigModel
from .endpoint import EndpointConfig, check_routing


class RewardEndpointConfig(EndpointConfig):
    """An external meshrl.v1.RewardService (the common endpoint settings, plus batching).

    After `max_retries` the circuit breaker opens and the items wait, probing the endpoint, until
    it answers or `max_wait_s` has passed. Items are never dropped nor scored as zero because an
    endpoint is down."""

    kind: ClassVar[str] = "reward endpoint"

    batch_size: int = Field(default=64, ge=1)
    """Items per Score call."""


class RewardServiceConfig(ConfigModel):
    """Reward application settings.

    Routing of an item by its data_source: an endpoint that lists it, else the custom reward
    function (it takes every data_source, as in verl), else a built-in scorer, else the catch-all
    endpoint (one with empty `data_sources`), else INVALID_ARGUMENT."""

    endpoints: list[RewardEndpointConfig] = []
    """External reward services."""
    max_batch_size: int = Field(default=64, ge=1)
    """Requests batched together by the Serve deployment."""
    batch_wait_timeout_s: float = Field(default=0.01, ge=0)
    """How long the deployment waits to fill a batch."""
    num_workers: int = Field(default=2, ge=1)
    """Threads (or processes, with `scorer_processes`) for scorers that block (math checking, sandboxes)."""
    scorer_processes: bool = True
    """Run blocking scorers (Math-Verify, sync custom functions) in worker processes, so a call past
    `item_timeout_s` is killed and frees its CPU at once; false: in threads, where a timed-out call
    runs on until it ends by itself."""
    item_timeout_s: float = Field(default=10.0, gt=0)
    """Deadline of one blocking scorer call (math-verify, a custom function), counted from when it
    starts running. A timed-out item scores 0 with metric `timeout`=1 (verl's math_verify
    semantics); with `scorer_processes` its process is killed, else its thread is abandoned."""
    max_abandoned_threads: int = Field(default=16, ge=1)
    """Abandoned scorer threads (timed out, or their caller cancelled) still running above which the replica reports unhealthy (Serve
    then replaces it, which ends them)."""
    max_items_per_request: int = Field(default=8192, ge=1)
    """Upper bound on items in one Score request."""

    @model_validator(mode="after")
    def _routing(self) -> RewardServiceConfig:
        check_routing(list(self.endpoints), "reward.endpoints")
        return self
