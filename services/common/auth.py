"""Who may call which RPC: one role table for every meshrl service, and the check that enforces it.

A caller proves a role with `authorization: Bearer <token>` metadata (any language can send it).
Three roles, each with its own token when tokens are configured:

    rollout   LeasePrompts RenewLeases ReturnLeases SubmitGroups WatchVersions, FetchWeights
              AcquireVersion ReleaseVersion Rendezvous(receiver), Score, Environment Start/Step/Close
    trainer   FetchBatch CommitVersion ReportCheckpoint ResumeTrainer, PublishWeights Rendezvous(sender)
    operator  GetStatus Pause Resume SetStaleness RequestCheckpoint Stop, the rollout and trainer
              services' control and status RPCs

`RPC_ROLES` below is the one table (a new service adds one entry, nothing else). `Authorizer.check`
is the one check, called before the request is validated: by `MeshInterceptor` on plain grpc.aio
servers and by `grpc_util.rpc_method` behind Ray Serve's gRPC proxy (which takes no interceptors).
No token configured at all: every call passes (and a server reachable from other hosts warns).
A missing or unknown token: UNAUTHENTICATED. A valid token of a role the RPC does not take:
PERMISSION_DENIED. An RPC of a meshrl service missing from the table is refused (fail closed).

Tokens come from the environment (`security.<role>_token_env`, default MESHRL_<ROLE>_TOKEN), never
from a config file. The operator token falls back to `coordinator.token`, then MESHRL_TOKEN; a role
without a token of its own shares the operator's, so one legacy token still protects everything.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .errors import PermissionDenied, Unauthenticated

if TYPE_CHECKING:
    from .config import MeshConfig

Role = Literal["rollout", "trainer", "operator"]
ROLLOUT: Role = "rollout"
TRAINER: Role = "trainer"
OPERATOR: Role = "operator"
ROLES: tuple[Role, ...] = (ROLLOUT, TRAINER, OPERATOR)
ANY_ROLE = frozenset(ROLES)

AUTH_METADATA_KEY = "authorization"
MESHRL_PACKAGE = "meshrl."
HOW_TO_SEND = "send metadata `authorization: Bearer <token>`"

_R, _T, _O = frozenset({ROLLOUT}), frozenset({TRAINER}), frozenset({OPERATOR})

RPC_ROLES: dict[str, dict[str, frozenset[Role]]] = {
    "meshrl.v1.CoordinatorService": {
        "LeasePrompts": _R, "RenewLeases": _R, "ReturnLeases": _R, "SubmitGroups": _R, "WatchVersions": _R,
        "FetchBatch": _T, "CommitVersion": _T, "ReportCheckpoint": _T, "ResumeTrainer": _T,
        "GetStatus": _O, "Pause": _O, "Resume": _O, "SetStaleness": _O, "RequestCheckpoint": _O, "Stop": _O,
        # A liveness probe and the benchmarks' baseline: any valid token.
        "Echo": ANY_ROLE,
    },
    "meshrl.v1.ParamServerService": {
        "PublishWeights": _T,
        "FetchWeights": _R, "AcquireVersion": _R, "ReleaseVersion": _R,
        # Read-only inspection.
        "GetManifest": ANY_ROLE, "ListVersions": ANY_ROLE,
        # Both sides meet here; the servicer lets only the trainer role check in as the sender.
        "Rendezvous": _R | _T,
    },
    "meshrl.v1.RewardService": {"Score": _R},
    "meshrl.v1.EnvironmentService": {"Start": _R, "Step": _R, "Close": _R},
    "meshrl.v1.RolloutService": {"Generate": _O, "UpdateWeights": _O, "GetRolloutStatus": _O, "Drain": _O},
    "meshrl.v1.TrainerService": {"GetTrainerStatus": _O, "SaveCheckpoint": _O},
}


def split_method(method: str) -> tuple[str, str]:
    """"/pkg.Service/Method" -> ("pkg.Service", "Method")."""
    _, service, name = method.split("/", 2) if method.startswith("/") else ("", *method.split("/", 1))
    return service, name


def roles_for(method: str) -> frozenset[Role] | None:
    """The roles that may call METHOD ("/meshrl.v1.Service/Method"); None for a method of another
    package (grpc health, reflection: open); an empty set for a meshrl RPC missing from the table."""
    service, name = split_method(method)
    if not service.startswith(MESHRL_PACKAGE):
        return None
    return RPC_ROLES.get(service, {}).get(name, frozenset())


@dataclass(frozen=True)
class Identity:
    """Who is calling: the roles their token proves (every role when auth is off or the call
    came from inside the process/cluster), and where from."""

    roles: frozenset[Role]
    peer: str = ""
    """Host of the peer ("" when unknown, e.g. behind Serve's proxy)."""
    subject: str = ""
    """mTLS client certificate subject, when one was presented."""
    authenticated: bool = False
    """A token was checked (False: auth is off, or a trusted in-process call)."""

    def has(self, role: Role) -> bool:
        return role in self.roles

    @property
    def key(self) -> str:
        """What per-client limits count by: the certificate subject, else roles and host."""
        if self.subject:
            return f"cert:{self.subject}"
        return f"{'+'.join(sorted(self.roles)) if self.authenticated else 'anonymous'}@{self.peer or '?'}"


TRUSTED = Identity(roles=ANY_ROLE)


def metadata_value(metadata: Iterable[Any] | None, key: str) -> str | None:
    """The first value of KEY in gRPC metadata (pairs or objects with key/value)."""
    for item in metadata or ():
        k, v = (item.key, item.value) if hasattr(item, "key") else item
        if k.lower() == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


@dataclass(frozen=True)
class Tokens:
    """One token per role (None: that role has none)."""

    rollout: str | None = None
    trainer: str | None = None
    operator: str | None = None

    def get(self, role: Role) -> str | None:
        return getattr(self, role)  # type: ignore[no-any-return]

    @property
    def any(self) -> bool:
        return bool(self.rollout or self.trainer or self.operator)

    def as_env(self, names: Mapping[Role, str] | None = None) -> dict[str, str]:
        """{env var: token} for the roles that have one (default names MESHRL_<ROLE>_TOKEN)."""
        names = names or default_env_names()
        return {names[r]: t for r in ROLES if (t := self.get(r))}


def default_env_names() -> dict[Role, str]:
    return {r: f"MESHRL_{r.upper()}_TOKEN" for r in ROLES}


def env_names(cfg: MeshConfig | None) -> dict[Role, str]:
    """{role: environment variable holding its token} for a config (defaults without one)."""
    if cfg is None:
        return default_env_names()
    s = cfg.security
    return {ROLLOUT: s.rollout_token_env, TRAINER: s.trainer_token_env, OPERATOR: s.operator_token_env}


def resolve_tokens(cfg: MeshConfig | None = None, env: Mapping[str, str] | None = None) -> Tokens:
    """The tokens a process holds: per-role environment variables; the operator's falls back to
    `coordinator.token`, then MESHRL_TOKEN; a role without its own shares the operator's."""
    env = os.environ if env is None else env
    names = env_names(cfg)
    got: dict[Role, str | None] = {r: env.get(names[r]) or None for r in ROLES}
    legacy = (cfg.coordinator.token if cfg is not None else None) or env.get("MESHRL_TOKEN") or None
    operator = got[OPERATOR] or legacy
    return Tokens(rollout=got[ROLLOUT] or operator, trainer=got[TRAINER] or operator, operator=operator)


@dataclass
class Authorizer:
    """Checks a call's token against the role table. Immutable after construction."""

    tokens: Tokens = field(default_factory=Tokens)
    table: Mapping[str, Mapping[str, frozenset[Role]]] = field(default_factory=lambda: RPC_ROLES)

    @classmethod
    def from_config(cls, cfg: MeshConfig | None = None, env: Mapping[str, str] | None = None) -> Authorizer:
        return cls(resolve_tokens(cfg, env))

    @property
    def enabled(self) -> bool:
        return self.tokens.any

    def roles_of(self, token: str) -> frozenset[Role]:
        """Every role whose token TOKEN is (compared in constant time, all of them)."""
        b = token.encode()
        return frozenset(r for r in ROLES if (t := self.tokens.get(r)) is not None and hmac.compare_digest(b, t.encode()))

    def allowed(self, method: str) -> frozenset[Role] | None:
        service, name = split_method(method)
        if not service.startswith(MESHRL_PACKAGE):
            return None
        return self.table.get(service, {}).get(name, frozenset())

    def check(self, method: str, metadata: Iterable[Any] | None, peer: str = "", subject: str = "") -> Identity:
        """The caller's Identity for METHOD, or raise Unauthenticated / PermissionDenied."""
        allowed = self.allowed(method)
        if not self.enabled or allowed is None:
            return Identity(roles=ANY_ROLE, peer=peer, subject=subject)
        got = metadata_value(metadata, AUTH_METADATA_KEY)
        if got is None:
            raise Unauthenticated(f"{method} needs a token: {HOW_TO_SEND} (a token of role {_names(allowed)})")
        scheme, _, value = got.strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise Unauthenticated(f"{method}: malformed authorization metadata; {HOW_TO_SEND}")
        roles = self.roles_of(value.strip())
        if not roles:
            raise Unauthenticated(f"{method}: the token matches no role; {HOW_TO_SEND} with a valid token")
        if not roles & allowed:
            if not allowed:
                raise PermissionDenied(f"{method} is not in the role table (services/common/auth.py); no role may call it")
            raise PermissionDenied(
                f"{method} needs a token of role {_names(allowed)}; the token presented is of role {_names(roles)}"
            )
        return Identity(roles=roles, peer=peer, subject=subject, authenticated=True)

    def require(self, identity: Identity, role: Role, what: str) -> None:
        """Inside a handler: only ROLE may do WHAT (e.g. check in as the rendezvous sender)."""
        if self.enabled and not identity.has(role):
            raise PermissionDenied(f"{what} needs a token of role {role}; the token presented is of role {_names(identity.roles)}")


def _names(roles: Iterable[str]) -> str:
    names = sorted(roles)
    return " or ".join(names) if names else "(none)"


# ---- the process's authorizer (behind Serve's proxy) --------------------------------------------

_process: dict[str, Any] = {}


def set_process_authorizer(auth: Authorizer | None) -> None:
    """What `rpc_method` checks with in this process when a servicer carries no `auth` of its own
    (a Serve replica sets it from its config at start; None: read the environment again)."""
    if auth is None:
        _process.pop("auth", None)
    else:
        _process["auth"] = auth


def process_authorizer() -> Authorizer:
    auth = _process.get("auth")
    if auth is None:
        auth = _process["auth"] = Authorizer.from_config(None)
    return auth  # type: ignore[no-any-return]
