"""`reward.*`: the reward service and its external endpoints."""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import ConfigModel


class RewardEndpointConfig(ConfigModel):
    """An external meshrl.v1.RewardService.

    Each Score call carries a deadline (`timeout_s`). A call that fails with a transient status
    (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED) is retried up to `max_retries`
    times with exponential backoff and full jitter; then the circuit breaker opens and the items
    wait, probing the endpoint every `breaker_open_s` (doubling up to `breaker_max_open_s`), until
    it answers or `max_wait_s` has passed. Items are never dropped nor scored as zero because an
    endpoint is down."""

    address: str
    """host:port of the service."""
    name: str | None = None
    """Label used in logs, status and errors; null: the address."""
    data_sources: list[str] = []
    """data_source values routed to this endpoint; empty: all not handled by a built-in scorer."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of one Score call."""
    max_retries: int = Field(default=5, ge=0)
    """Retries after the first attempt (exponential backoff with jitter)."""
    batch_size: int = Field(default=64, ge=1)
    """Items per Score call."""
    max_concurrent_calls: int = Field(default=4, ge=1)
    """Score calls in flight to this endpoint at once."""
    backoff_initial_s: float = Field(default=0.2, gt=0)
    """Upper bound of the first retry's (jittered) sleep; doubles per retry."""
    backoff_max_s: float = Field(default=10.0, gt=0)
    """Largest retry sleep."""
    breaker_failure_threshold: int = Field(default=5, ge=1)
    """Consecutive failed attempts (across all calls) that open the circuit breaker."""
    breaker_open_s: float = Field(default=2.0, gt=0)
    """How long the breaker stays open before one probe call is let through."""
    breaker_max_open_s: float = Field(default=30.0, gt=0)
    """Cap of the open period, which doubles after each failed probe."""
    max_wait_s: float | None = Field(default=None, gt=0)
    """How long items may wait for this endpoint to come back before Score fails with
    UNAVAILABLE (the caller keeps its group); null: wait until it returns."""
    token: str | None = None
    """Bearer token sent as `authorization` metadata."""
    token_env: str | None = None
    """Environment variable holding the token (keeps secrets out of config files); used when
    `token` is null."""
    tls: bool = False
    """Use TLS (system roots, or `ca_file`)."""
    ca_file: str | None = None
    """PEM root certificates for TLS."""
    tls_server_name: str | None = None
    """Override of the TLS server name checked against the certificate (e.g. when `address` is an IP)."""

    @model_validator(mode="after")
    def _check(self) -> RewardEndpointConfig:
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"reward endpoint address {self.address!r} is not host:port; write e.g. 127.0.0.1:50061")
        if (self.ca_file or self.tls_server_name) and not self.tls:
            raise ValueError(f"reward endpoint {self.address}: ca_file/tls_server_name are set but tls is false; set tls: true")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"reward endpoint {self.address}: backoff_max_s < backoff_initial_s; raise backoff_max_s")
        if self.breaker_max_open_s < self.breaker_open_s:
            raise ValueError(f"reward endpoint {self.address}: breaker_max_open_s < breaker_open_s; raise breaker_max_open_s")
        return self

    @property
    def label(self) -> str:
        return self.name or self.address


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
    """Timed-out scorer threads still running above which the replica reports unhealthy (Serve
    then replaces it, which ends them)."""
    max_items_per_request: int = Field(default=8192, ge=1)
    """Upper bound on items in one Score request."""

    @model_validator(mode="after")
    def _routing(self) -> RewardServiceConfig:
        owner: dict[str, str] = {}
        catch_all: list[str] = []
        labels: set[str] = set()
        for i, ep in enumerate(self.endpoints):
            if ep.label in labels:
                raise ValueError(f"reward.endpoints[{i}]: two endpoints are called {ep.label!r}; give them distinct names")
            labels.add(ep.label)
            if not ep.data_sources:
                catch_all.append(ep.label)
            for ds in ep.data_sources:
                if ds in owner:
                    raise ValueError(
                        f"reward.endpoints[{i}].data_sources: {ds!r} is already routed to {owner[ds]!r}; "
                        "list each data_source under one endpoint"
                    )
                owner[ds] = ep.label
        if len(catch_all) > 1:
            raise ValueError(
                f"reward.endpoints: {catch_all} all have empty data_sources (catch-all); at most one may, list data_sources for the others"
            )
        return self
