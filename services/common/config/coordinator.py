"""`coordinator.*`: what the coordinator service can be told."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import ConfigModel


class CoordinatorConfig(ConfigModel):
    """The coordinator: leases, ledger and the control plane."""

    host: str = "127.0.0.1"
    """Bind address of the plain grpc.aio server (`meshrl coordinator serve`)."""
    port: int = Field(default=50051, ge=0, le=65535)
    """Port of the plain grpc.aio server; 0 picks a free one."""
    lease_timeout_s: float = Field(default=600.0, gt=0)
    """A lease not submitted, renewed or returned within this time expires and its prompt is
    re-issued. The bound for a live replica that is slow; a dead one is found by
    `replica_ttl_s`."""
    replica_ttl_s: float | None = Field(default=20.0, gt=0)
    """A rollout replica that holds leases and has made no call for this long (it renews every
    `rollout_worker.lease_renew_interval_s`, a few seconds: its heartbeat) is taken for dead: its
    leases expire at once and their prompts are re-issued. null: leases end only at
    `lease_timeout_s`."""
    max_consecutive_failures: int | None = Field(default=32, ge=1)
    """Prompt groups that failed in a row (a replica gave the lease back with an error: a reward
    endpoint or engine that keeps failing), with no accepted group in between, after which no
    lease is granted and GetStatus reports the reason (`halted_reason`): `meshrl train` stops the
    run with it, an operator lifts it with `meshrl resume`. null: never halt."""
    max_prompt_failures: int | None = Field(default=8, ge=1)
    """A prompt whose groups failed this many times, each on a replica that had a group accepted
    since its own last failure (so a replica that fails everything, or an outage, counts once:
    that is `max_consecutive_failures`' case), is set aside: never leased again, counted in GetStatus
    (`totals.prompts_set_aside`), logged (`prompt_set_aside`, with the error) and accounted for by
    the ledger audit. A failed prompt is re-issued at once, so without this one that always fails
    (a template it breaks, data a tool cannot take) comes back for as long as the run lasts.
    Where groups fail at random (a flaky endpoint failing a share p of them), about p**8 of the
    prompts are set aside. null: never set aside."""
    ledger_path: str | None = None
    """SQLite ledger file; null: `<run_dir>/ledger.sqlite`. Restarting on the same file resumes the run."""
    ledger_synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    """SQLite `synchronous` in WAL mode: NORMAL survives a process crash, FULL also a power loss."""
    token: str | None = None
    """Older single token: the operator role's token when MESHRL_OPERATOR_TOKEN is unset (then
    MESHRL_TOKEN), and every other role's when they have none of their own (see `security`).
    `meshrl train` keeps it out of config.resolved.yaml; prefer the environment variables."""
    tls_cert_file: str | None = None
    """PEM certificate chain of the plain coordinator server (overrides security.tls.cert_file for
    it); with `tls_key_file` the server speaks TLS only. Ray Serve's gRPC ingress has no TLS."""
    tls_key_file: str | None = None
    """PEM private key matching `tls_cert_file`."""
    max_groups_per_call: int = Field(default=1024, ge=1)
    """Upper bound on groups in one LeasePrompts/SubmitGroups call."""
    max_message_mb: int = Field(default=64, ge=1)
    """gRPC message size limit (both directions)."""
    max_response_tokens: int = Field(default=1 << 20, ge=1)
    """Sanity bound on tokens per submitted response."""

    @model_validator(mode="after")
    def _tls_pair(self) -> CoordinatorConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set both coordinator.tls_cert_file and coordinator.tls_key_file (or neither)")
        return self
