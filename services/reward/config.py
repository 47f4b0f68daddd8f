"""`reward.*`: the reward service and its external endpoints."""

from __future__ import annotations

from pydantic import Field

from services.common.config.base import ConfigModel


class RewardEndpointConfig(ConfigModel):
    """An external meshrl.v1.RewardService."""

    address: str
    """host:port of the service."""
    data_sources: list[str] = []
    """data_source values routed to this endpoint; empty: all not handled by a built-in scorer."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of one Score call."""
    max_retries: int = Field(default=5, ge=0)
    """Retries after the first attempt (exponential backoff with jitter)."""
    batch_size: int = Field(default=64, ge=1)
    """Items per Score call."""
    token: str | None = None
    """Bearer token sent as `authorization` metadata."""
    tls: bool = False
    """Use TLS (system roots, or `ca_file`)."""
    ca_file: str | None = None
    """PEM root certificates for TLS."""


class RewardServiceConfig(ConfigModel):
    """Reward application settings."""

    endpoints: list[RewardEndpointConfig] = []
    """External reward services."""
    max_batch_size: int = Field(default=64, ge=1)
    """Requests batched together by the Serve deployment."""
    batch_wait_timeout_s: float = Field(default=0.01, ge=0)
    """How long the deployment waits to fill a batch."""
    num_workers: int = Field(default=2, ge=1)
    """Threads for scorers that block (math checking, sandboxes)."""
