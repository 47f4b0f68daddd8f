"""`security.*`: who may call which RPC (tokens per role), TLS, and the bounds every plain gRPC
server enforces. Secrets never live in a config: tokens are read from the environment variables
named here (`meshrl train` sets fresh ones per run), so `config.resolved.yaml` holds none."""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import ConfigModel


class TlsConfig(ConfigModel):
    """TLS for meshrl's plain gRPC servers (coordinator, param server data plane, reward, and any
    server built by services.common.grpc_util.create_server) and their meshrl clients. Ray Serve's
    gRPC ingress cannot speak TLS (Ray 2.60 binds it with add_insecure_port); see the README's
    security model for what must then stay on a trusted network."""

    cert_file: str | None = None
    """PEM certificate chain every plain meshrl server of this config presents; with `key_file`
    the servers speak TLS only, and meshrl's clients of those servers use TLS."""
    key_file: str | None = None
    """PEM private key matching `cert_file`."""
    client_ca_file: str | None = None
    """mTLS: servers require a client certificate that chains to this PEM CA bundle (a client
    without one cannot connect)."""
    ca_file: str | None = None
    """Clients: PEM roots that verify the servers' certificates; null: the system roots."""
    client_cert_file: str | None = None
    """Clients: PEM certificate chain presented to servers that ask for one (mTLS)."""
    client_key_file: str | None = None
    """Clients: PEM private key matching `client_cert_file`."""
    server_name: str | None = None
    """Clients: the name checked against the server's certificate, when it differs from the
    host dialled (e.g. an IP address)."""

    @model_validator(mode="after")
    def _pairs(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("set both security.tls.cert_file and security.tls.key_file (or neither)")
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError("set both security.tls.client_cert_file and security.tls.client_key_file (or neither)")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("security.tls.client_ca_file (mTLS) needs server TLS: set security.tls.cert_file and key_file")
        return self


class LimitsConfig(ConfigModel):
    """Bounds on what one client can hold on a plain meshrl gRPC server. A request over a bound is
    refused with RESOURCE_EXHAUSTED (concurrency) or INVALID_ARGUMENT (sizes), naming the key."""

    max_concurrent_rpcs: int = Field(default=2048, ge=1)
    """RPCs in progress on one server at once, streams included; more are refused."""
    max_concurrent_rpcs_per_client: int = Field(default=512, ge=1)
    """RPCs in progress at once per client identity (its role and host, or its mTLS certificate)."""
    max_streams_per_client: int = Field(default=128, ge=1)
    """Streaming RPCs (WatchVersions, FetchWeights, PublishWeights ...) open at once per client
    identity."""
    max_streams_per_connection: int = Field(default=256, ge=1)
    """HTTP/2 streams one connection may have open (the client queues the rest)."""
    stream_stall_timeout_s: float = Field(default=120.0, gt=0)
    """A server stream whose reader takes no message for this long is cut (DEADLINE_EXCEEDED) and
    what it held (e.g. a FetchWeights pin on a version) is released. An idle stream with nothing
    to send (WatchVersions between commits) is not stalled."""
    max_connection_idle_s: float = Field(default=1800.0, gt=0)
    """A connection with no RPC in progress for this long is closed (clients reconnect on their
    next call)."""
    max_connection_age_s: float = Field(default=7200.0, gt=0)
    """A connection is asked to go away after this long (GOAWAY); new calls open a new one."""
    max_connection_age_grace_s: float = Field(default=1800.0, gt=0)
    """Calls still running on a connection past its age get this long to finish, then are cut (a
    WatchVersions stream then reconnects)."""
    keepalive_time_s: float = Field(default=30.0, gt=0)
    """Clients ping an idle connection this often to detect a dead peer."""
    keepalive_timeout_s: float = Field(default=10.0, gt=0)
    """A ping not answered within this long closes the connection."""
    keepalive_min_time_s: float = Field(default=10.0, gt=0)
    """Servers accept client pings this often (at most), with or without calls in progress; must
    not exceed `keepalive_time_s`, or the servers would send meshrl's own clients GOAWAY
    too_many_pings."""
    max_id_chars: int = Field(default=256, ge=8)
    """Longest id in a request (replica_id, lease_id, trainer_id, consumer_id, item_id ...)."""
    max_address_chars: int = Field(default=512, ge=16)
    """Longest address in a request (host:port, param_server_address, master_address)."""
    max_path_chars: int = Field(default=4096, ge=64)
    """Longest path or URI in a request (checkpoint paths)."""
    max_name_chars: int = Field(default=1024, ge=16)
    """Longest other short string in a request (tensor names, data sources, roles, backends,
    checksums, transports, stop strings)."""
    max_json_depth: int = Field(default=64, ge=2)
    """Deepest nesting accepted in JSON payloads (reward extra_info, environment payloads)."""

    @model_validator(mode="after")
    def _keepalive(self) -> LimitsConfig:
        if self.keepalive_min_time_s > self.keepalive_time_s:
            raise ValueError(
                f"security.limits.keepalive_min_time_s={self.keepalive_min_time_s} exceeds keepalive_time_s="
                f"{self.keepalive_time_s}: servers would refuse meshrl's own pings (GOAWAY too_many_pings); lower it"
            )
        if self.max_concurrent_rpcs_per_client > self.max_concurrent_rpcs:
            raise ValueError("security.limits.max_concurrent_rpcs_per_client exceeds max_concurrent_rpcs; lower it")
        return self


class SecurityConfig(ConfigModel):
    """Authentication (a bearer token per role), TLS and resource bounds.

    Roles: `rollout` (lease, renew, return, submit, watch, fetch weights, score), `trainer` (fetch
    batch, commit, checkpoint reports, publish weights, rendezvous as sender), `operator` (control
    RPCs and status). When any token is set every meshrl RPC needs one: a missing or wrong token
    is UNAUTHENTICATED, a token of another role PERMISSION_DENIED. A role without a token of its
    own shares the operator's (so the older single `coordinator.token` / MESHRL_TOKEN still works:
    it is the operator token, and with no other token set every role uses it)."""

    rollout_token_env: str = "MESHRL_ROLLOUT_TOKEN"
    """Environment variable holding the rollout role's token."""
    trainer_token_env: str = "MESHRL_TRAINER_TOKEN"
    """Environment variable holding the trainer role's token."""
    operator_token_env: str = "MESHRL_OPERATOR_TOKEN"
    """Environment variable holding the operator role's token (MESHRL_TOKEN and
    `coordinator.token` are read when it is unset)."""
    tls: TlsConfig = TlsConfig()
    """TLS and mTLS of the plain gRPC servers and their clients."""
    limits: LimitsConfig = LimitsConfig()
    """Per-server and per-client bounds of the plain gRPC servers."""
