"""Credentials of meshrl's gRPC edges: TLS for servers, TLS and a role's token for clients, and the
one-line warning a server gives when anyone who reaches its port may call it.

    creds = server_credentials(cfg.security.tls)        # None: plaintext
    sec = client_security(cfg, "rollout")                # token + TLS of this process's clients
    use_role(cfg, "rollout")                             # ... and make it this process's default

A process is one role (a rollout replica, the trainer and its ranks, the driver/CLI as operator):
`use_role` sets the security every meshrl client in the process uses unless it is given its own,
so code deep in a transport need not carry tokens around. Servers get their Authorizer the same
way (services.common.auth.set_process_authorizer).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from .auth import Authorizer, Role, resolve_tokens, set_process_authorizer
from .logging import get_logger

if TYPE_CHECKING:
    from .config import MeshConfig
    from .config.security import TlsConfig

log = get_logger(__name__)


@dataclass(frozen=True)
class ChannelSecurity:
    """What a client channel presents: a bearer token on every call, TLS (with a client
    certificate for mTLS)."""

    token: str | None = None
    tls: bool = False
    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None

    def plaintext(self) -> ChannelSecurity:
        """The same token without TLS (for Ray Serve's gRPC ingress, which has no TLS)."""
        return replace(self, tls=False, root_certificates=None, certificate_chain=None, private_key=None,
                       server_name=None)

    def with_token(self, token: str | None) -> ChannelSecurity:
        return replace(self, token=token)

    def with_tls(self, *, tls: bool, ca_file: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None, server_name: str | None = None) -> ChannelSecurity:
        """TLS switched on (or kept) with the given files overriding this one's."""
        if not (tls or ca_file or cert_file):
            return self
        return replace(
            self, tls=True,
            root_certificates=_read(ca_file) if ca_file else self.root_certificates,
            certificate_chain=_read(cert_file) if cert_file else self.certificate_chain,
            private_key=_read(key_file) if key_file else self.private_key,
            server_name=server_name or self.server_name,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates, private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


def _read(path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read {path}: {exc.strerror}") from exc


def server_credentials(tls: TlsConfig, *, cert_file: str | None = None, key_file: str | None = None) -> Any:
    """grpc server credentials for TLS (mTLS when `client_ca_file` is set), or None for plaintext.
    CERT_FILE/KEY_FILE override the config's (a service's own older keys, e.g. coordinator.tls_*)."""
    cert, key = cert_file or tls.cert_file, key_file or tls.key_file
    if not (cert and key):
        return None
    client_ca = _read(tls.client_ca_file) if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def client_security(cfg: MeshConfig | None, role: Role | None, *, tls: bool | None = None) -> ChannelSecurity:
    """The security of a ROLE's clients under CFG: its token, and TLS when the config's servers
    speak it (`security.tls.cert_file`) or TLS is forced on."""
    token = resolve_tokens(cfg).get(role) if role else None
    if cfg is None:
        return ChannelSecurity(token=token)
    t = cfg.security.tls
    use_tls = bool(t.cert_file) if tls is None else tls
    if not use_tls:
        return ChannelSecurity(token=token)
    return ChannelSecurity(
        token=token, tls=True,
        root_certificates=_read(t.ca_file) if t.ca_file else None,
        certificate_chain=_read(t.client_cert_file) if t.client_cert_file else None,
        private_key=_read(t.client_key_file) if t.client_key_file else None,
        server_name=t.server_name,
    )


_default: dict[str, ChannelSecurity] = {}


def use_role(cfg: MeshConfig | None, role: Role | None) -> ChannelSecurity:
    """Make ROLE's security this process's default for meshrl clients, and CFG's tokens what this
    process's servers check (behind Serve's proxy). Returns the client security."""
    from .limits import Limits, set_process_limits

    sec = client_security(cfg, role)
    _default["security"] = sec
    set_process_authorizer(Authorizer.from_config(cfg))
    set_process_limits(Limits.from_config(cfg.security.limits) if cfg is not None else None)
    return sec


def reset_process_security() -> None:
    """Forget `use_role` (tests)."""
    from .limits import set_process_limits

    _default.pop("security", None)
    set_process_authorizer(None)
    set_process_limits(None)


def default_security(*, ingress: bool = False) -> ChannelSecurity:
    """This process's client security (`use_role`; none set: no token, no TLS). INGRESS: the
    channel goes to Ray Serve's gRPC proxy, which has no TLS."""
    sec = _default.get("security") or ChannelSecurity()
    return sec.plaintext() if ingress else sec


# ---- "anyone who reaches this port may call it" -------------------------------------------------

_warned: set[str] = set()


def is_loopback(host: str) -> bool:
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def warn_if_exposed(service: str, host: str, *, auth: Authorizer, tls: bool | None,
                    fix_key: str = "security.tls.cert_file") -> bool:
    """Log once per (service, host) when a server bound to HOST (not loopback) lacks tokens, or
    TLS where it could have it (TLS None: this edge cannot do TLS, e.g. Ray Serve's gRPC proxy).
    Returns whether it warned."""
    missing = [what for what, ok in (("tokens", auth.enabled), ("TLS", tls is not False)) if not ok]
    if is_loopback(host) or not missing:
        return False
    key = f"{service}@{host}"
    if key in _warned:
        return False
    _warned.add(key)
    fixes = []
    if not auth.enabled:
        fixes.append("set MESHRL_ROLLOUT_TOKEN, MESHRL_TRAINER_TOKEN and MESHRL_OPERATOR_TOKEN in every service's "
                     "environment (meshrl train does)")
    if tls is False:
        fixes.append(f"set {fix_key} and its key_file")
    log.warning(
        "server_exposed", service=service, bind=host, missing=missing,
        risk="anyone who reaches this port can call every RPC" if not auth.enabled else "tokens travel in plaintext",
        fix="; ".join(fixes) + "; or bind to 127.0.0.1",
    )
    return True


@dataclass
class ServerSecurity:
    """What a plain server of a config checks and presents: its Authorizer, TLS credentials (None:
    plaintext) and bounds."""

    auth: Authorizer
    credentials: Any
    limits: Any

    @classmethod
    def from_config(
        cls, cfg: MeshConfig | None, *, cert_file: str | None = None, key_file: str | None = None
    ) -> ServerSecurity:
        from .config.security import LimitsConfig, TlsConfig

        tls = cfg.security.tls if cfg is not None else TlsConfig()
        limits = cfg.security.limits if cfg is not None else LimitsConfig()
        return cls(Authorizer.from_config(cfg), server_credentials(tls, cert_file=cert_file, key_file=key_file), limits)

    @property
    def tls(self) -> bool:
        return self.credentials is not None

    def warn_if_exposed(self, service: str, host: str, fix_key: str = "security.tls.cert_file") -> bool:
        return warn_if_exposed(service, host, auth=self.auth, tls=self.tls, fix_key=fix_key)


def serve_replica_security(cfg: MeshConfig, role: Role | None, service: str) -> ChannelSecurity:
    """In a Ray Serve replica's __init__: ROLE's client security becomes the process default, the
    config's tokens what `rpc_method` checks, and a replica reachable without tokens says so once
    (Serve's gRPC proxy listens on every interface and cannot do TLS)."""
    sec = use_role(cfg, role)
    warn_if_exposed(service, "::", auth=Authorizer.from_config(cfg), tls=None)
    return sec
