"""How meshrl calls an external gRPC service: the settings every `*.endpoints[i]` shares
(reward.endpoints, environment.endpoints). services/common/endpoints.py implements them."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from .base import ConfigModel


class EndpointConfig(ConfigModel):
    """An external gRPC service.

    Each call carries a deadline (`timeout_s`). A call that fails with a transient status
    (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED) is retried up to `max_retries`
    times with exponential backoff and full jitter; then the circuit breaker opens and the call
    waits, probing the endpoint every `breaker_open_s` (doubling up to `breaker_max_open_s`), until
    it answers or `max_wait_s` has passed (then it fails with UNAVAILABLE)."""

    kind: ClassVar[str] = "endpoint"
    """What the endpoint is, for messages ("reward endpoint 127.0.0.1:1 ...")."""

    address: str
    """host:port of the service."""
    name: str | None = None
    """Label used in logs, status and errors; null: the address."""
    data_sources: list[str] = []
    """data_source values routed to this endpoint; empty: all that nothing else takes."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of one call."""
    max_retries: int = Field(default=5, ge=0)
    """Retries after the first attempt (exponential backoff with jitter)."""
    max_concurrent_calls: int = Field(default=4, ge=1)
    """Calls in flight to this endpoint at once."""
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
    """How long a call may wait for this endpoint to come back before it fails with UNAVAILABLE;
    null: wait until it returns."""
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
    def _check_endpoint(self) -> EndpointConfig:
        what = f"{self.kind} {self.address}"
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{self.kind} address {self.address!r} is not host:port; write e.g. 127.0.0.1:50061")
        if (self.ca_file or self.tls_server_name) and not self.tls:
            raise ValueError(f"{what}: ca_file/tls_server_name are set but tls is false; set tls: true")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"{what}: backoff_max_s < backoff_initial_s; raise backoff_max_s")
        if self.breaker_max_open_s < self.breaker_open_s:
            raise ValueError(f"{what}: breaker_max_open_s < breaker_open_s; raise breaker_max_open_s")
        return self

    @property
    def label(self) -> str:
        return self.name or self.address


def check_routing(endpoints: list[EndpointConfig], key: str) -> None:
    """Distinct labels; each data_source routed to one endpoint; at most one catch-all. `key` is
    the config path of the list ("reward.endpoints")."""
    owner: dict[str, str] = {}
    catch_all: list[str] = []
    labels: set[str] = set()
    for i, ep in enumerate(endpoints):
        if ep.label in labels:
            raise ValueError(f"{key}[{i}]: two endpoints are called {ep.label!r}; give them distinct names")
        labels.add(ep.label)
        if not ep.data_sources:
            catch_all.append(ep.label)
        for ds in ep.data_sources:
            if ds in owner:
                raise ValueError(
                    f"{key}[{i}].data_sources: {ds!r} is already routed to {owner[ds]!r}; "
                    "list each data_source under one endpoint"
                )
            owner[ds] = ep.label
    if len(catch_all) > 1:
        raise ValueError(
            f"{key}: {catch_all} all have empty data_sources (catch-all); at most one may, list data_sources for the others"
        )
