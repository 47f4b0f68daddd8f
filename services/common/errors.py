"""The exception tree shared by every service, and the one table that maps it to gRPC codes.

Core code raises these; servicers translate them at the gRPC boundary (see grpc_util.rpc_method),
so the same error reads the same whether the service runs under Ray Serve or a plain grpc.aio
server. `ValueError` subclasses are for callers who passed something wrong; invariant violations
inside meshrl are `assert`s.
"""

from __future__ import annotations

import grpc


class MeshError(Exception):
    """Base of every error meshrl raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(MeshError, ValueError):
    """A request or config value is malformed. `field` names it (dotted path)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Picklable with its two-argument constructor: Ray Serve ships a replica's exception to
        # the gRPC proxy, and an unpicklable one turns the status code into INTERNAL.
        return (type(self), (self.field, self.reason))


class ConfigError(MeshError, ValueError):
    """A config file or override is invalid; the message names the key and the fix."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(MeshError):
    """The request is well-formed but the state does not allow it (wrong version, stopping ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(MeshError):
    """No credentials, or credentials that match no role (missing or wrong token)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(MeshError):
    """Valid credentials of a role that may not call this RPC."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(MeshError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(MeshError):
    """A dependency (reward endpoint, param server, engine) cannot serve right now; retryable."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(MeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DataLoss(MeshError):
    """Bytes did not match their checksum."""

    code = grpc.StatusCode.DATA_LOSS


class BadReply(MeshError):
    """A peer (an external reward or environment endpoint) answered outside its contract. Its
    fault, not the request's: the caller fails the work and returns it, and never takes the
    request for bad input (a rollout stops on that). `source` names the peer."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, source: str, reason: str) -> None:
        self.source = source
        self.reason = reason
        super().__init__(f"{source}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.source, self.reason))


class MissingDependency(MeshError, ImportError):
    """An optional dependency is not installed; the message says which extra to install."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, what: str, install_hint: str) -> None:
        self.what = what
        self.install_hint = install_hint
        super().__init__(f"{what} is not available: {install_hint}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.what, self.install_hint))


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception to (gRPC status code, details). Unknown exceptions are INTERNAL."""
    if isinstance(exc, MeshError):
        return exc.code, str(exc)
    if isinstance(exc, (TimeoutError,)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def root_cause(exc: BaseException) -> BaseException:
    """The exception a Ray task or Serve replica raised, not the RayTaskError(s) around it."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError: what the task raised
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return exc


def first_cause(exc: BaseException, limit: int = 500) -> str:
    """The error a person must read, on one line: the exception a Ray task or Serve replica
    raised (not the RayTaskError around it and its remote traceback), a gRPC error's code and
    details, whitespace collapsed, cut at `limit` characters."""
    exc = root_cause(exc)
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if isinstance(exc, grpc.RpcError) and callable(code) and callable(details):
        text = f"{getattr(code(), 'name', code())}: {details()}"
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_REPLICA_DIED = ("The actor died unexpectedly", "ActorDiedError", "ActorUnavailableError", "RayActorError")


def transient(exc: BaseException) -> bool:
    """True for a failure of the service called, not of the request: UNAVAILABLE or DEADLINE_EXCEEDED
    (a gRPC error or their MeshError), and INTERNAL from Serve's gRPC proxy when the replica
    serving the call died under it (Serve then starts another). Worth a bounded retry; a request
    that is not idempotent needs a way to learn what the dead call did (see its caller)."""
    code = exc.code() if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)) else None  # type: ignore[attr-defined]
    if code is None and isinstance(exc, MeshError):
        code = exc.code
    if code in _TRANSIENT_CODES:
        return True
    if code == grpc.StatusCode.INTERNAL:
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)  # type: ignore[attr-defined]
        return any(s in str(details) for s in _REPLICA_DIED)
    return False
