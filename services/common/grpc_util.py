"""gRPC edges shared by every service: server and channel factories, the error boundary, auth.

Error boundary. Servicer methods are wrapped with `rpc_method`: a MeshError (or any exception)
becomes a status code from `errors.status_for`. Under a plain grpc.aio server the context has
`abort`; under Ray Serve's gRPC proxy it is a RayServegRPCContext, where a raised exception turns
into INTERNAL unless the code was set on the context first (Ray >= 2.55), so we set code and
details, then raise. Either way the client sees the same code and message.

Auth and bounds. Every meshrl RPC needs `authorization: Bearer <token>` metadata of a role the
role table allows (services/common/auth.py) when tokens are configured. Plain servers made by
`create_server` check it, the request's decoding and string lengths, and per-client concurrency in
`MeshInterceptor` (services/common/interceptor.py); behind Ray Serve's gRPC proxy, which accepts
no interceptors, `rpc_method` checks auth and lengths with the same code.

Keepalive. Clients ping every `keepalive_time_s` (30 s) and servers accept pings every
`keepalive_min_time_s` (10 s), with or without calls, so an idle stream (WatchVersions between
commits) is never sent GOAWAY too_many_pings. Ray Serve's proxy keeps gRPC's default policy (a
ping without data at most every 5 min, 2 strikes), so channels to it (`ingress=True`) ping every
330 s and only while a call is open.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from services.common.auth import AUTH_METADATA_KEY, TRUSTED, Authorizer, Identity, process_authorizer
from services.common.errors import MeshError, status_for
from services.common.interceptor import CallContext, MeshInterceptor, identity_of
from services.common.limits import ClientLimiter, Limits, check_lengths
from services.common.logging import get_logger
from services.common.security import ChannelSecurity

log = get_logger(__name__)

MiB = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB
MAX_STATUS_DETAILS = 2000
INGRESS_KEEPALIVE_S = 330.0

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Keepalive:
    """What clients and servers agree on (security.limits.keepalive_*)."""

    time_s: float = 30.0
    timeout_s: float = 10.0
    min_time_s: float = 10.0

    @classmethod
    def from_config(cls, limits: Any) -> Keepalive:
        return cls(limits.keepalive_time_s, limits.keepalive_timeout_s, limits.keepalive_min_time_s)


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def message_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *, keepalive: Keepalive | None = None, ingress: bool = False
) -> list[tuple[str, Any]]:
    """Channel options: symmetric size limits, keepalive that the far side accepts (a meshrl
    server, or with INGRESS Ray Serve's proxy; see the module docstring), a short reconnect backoff."""
    k = keepalive or Keepalive()
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", _ms(max(k.time_s, INGRESS_KEEPALIVE_S) if ingress else k.time_s)),
        ("grpc.keepalive_timeout_ms", _ms(k.timeout_s)),
        ("grpc.keepalive_permit_without_calls", 0 if ingress else 1),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC's own reconnect backoff grows to 120 s by default: a service that Serve replaced (or
        # one that came up late) would fail its callers' retries for minutes after it is back.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, limits: Any = None) -> list[tuple[str, Any]]:
    """Server options: size limits, the ping policy meshrl's clients need, connection idle/age
    bounds and streams per connection (security.limits)."""
    from services.common.config.security import LimitsConfig

    lim = limits or LimitsConfig()
    k = Keepalive.from_config(lim)
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Accept client pings every min_time_s even with no call open or no data flowing.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(k.min_time_s)),
        ("grpc.http2.max_ping_strikes", 2),
        # Find dead clients that hold streams (a killed replica's WatchVersions).
        ("grpc.keepalive_time_ms", _ms(max(60.0, 2 * k.time_s))),
        ("grpc.keepalive_timeout_ms", _ms(max(20.0, k.timeout_s))),
        ("grpc.max_connection_idle_ms", _ms(lim.max_connection_idle_s)),
        ("grpc.max_connection_age_ms", _ms(lim.max_connection_age_s)),
        ("grpc.max_connection_age_grace_ms", _ms(lim.max_connection_age_grace_s)),
        ("grpc.max_concurrent_streams", lim.max_streams_per_connection),
        # SO_REUSEPORT off (grpc turns it on by default): a second server on a port in use must
        # fail to bind, not silently share the port and receive half of another run's connections.
        ("grpc.so_reuseport", 0),
    ]


def create_channel(
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: bool = False,
    root_certificates: bytes | None = None,
    security: ChannelSecurity | None = None,
    ingress: bool = False,
    keepalive: Keepalive | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel with meshrl's limits. TLS from SECURITY (or the older TLS/ROOT_CERTIFICATES
    arguments); INGRESS: the address is Ray Serve's gRPC proxy (plaintext, its ping policy). Tokens
    travel as call metadata (`bearer_metadata`), not here. Pass deadlines per call (`timeout=`)."""
    sec = security or ChannelSecurity()
    if tls or root_certificates is not None:
        sec = ChannelSecurity(sec.token, True, root_certificates or sec.root_certificates, sec.certificate_chain,
                              sec.private_key, sec.server_name)
    options = message_options(max_message_bytes, keepalive=keepalive, ingress=ingress)
    if sec.tls:
        if sec.server_name:
            options.append(("grpc.ssl_target_name_override", sec.server_name))
        return grpc.aio.secure_channel(address, sec.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def create_server(
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    maximum_concurrent_rpcs: int | None = None,
    auth: Authorizer | None = None,
    limits: Any = None,
) -> grpc.aio.Server:
    """A grpc.aio server whose meshrl RPCs go through MeshInterceptor first. AUTH: whose tokens to
    accept (None: this process's, from the environment); LIMITS: a `security.limits` section (None:
    the defaults)."""
    from services.common.config.security import LimitsConfig

    lim = limits or LimitsConfig()
    mesh = MeshInterceptor(
        auth if auth is not None else process_authorizer(),
        limits=Limits.from_config(lim),
        limiter=ClientLimiter(lim.max_concurrent_rpcs_per_client, lim.max_streams_per_client),
        stall_timeout_s=lim.stream_stall_timeout_s,
    )
    return grpc.aio.server(
        options=server_options(max_message_bytes, lim),
        interceptors=[mesh, *interceptors],
        maximum_concurrent_rpcs=maximum_concurrent_rpcs or lim.max_concurrent_rpcs,
    )


def bind_port(server: grpc.aio.Server, address: str, key: str, credentials: Any = None) -> int:
    """Bind ADDRESS (host:port, port 0 = any free one); returns the port. A port in use gives an
    OSError naming the config KEY to change."""
    try:
        port = server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot bind {address} ({key}): the port is in use (another run on this node?) or the host "
                      f"is not local; set {key} to a free port, or 0 for any free one")
    return port


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> Any:
    """Serve grpc.health.v1 and reflection for `service_names` (full names, e.g.
    "meshrl.v1.CoordinatorService"). Returns the health servicer (None when grpcio-health-checking
    is not installed; reflection is skipped likewise)."""
    names = list(service_names)
    health = None
    try:
        from grpc_health.v1 import health as health_mod
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_mod.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        names.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    except ImportError:
        log.info("grpc_health_unavailable", hint="pip install grpcio-health-checking")
    try:
        _add_reflection(server, names)
    except ImportError:
        log.info("grpc_reflection_unavailable", hint="pip install grpcio-reflection")
    return health


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _add_reflection(server: grpc.aio.Server, names: list[str]) -> None:
    """Reflection as v1 (what current grpcurl and grpcui ask first) and v1alpha (older clients).
    grpcio-reflection ships only v1alpha; the v1 messages are wire-identical (same fields, another
    package), so the same servicer answers both."""
    from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

    servicer = reflection.aio.ReflectionServicer([*names, REFLECTION_V1, reflection.SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),))


async def set_serving(health: Any, service_names: Iterable[str]) -> None:
    if health is None:
        return
    from grpc_health.v1 import health_pb2

    for name in ["", *service_names]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)


def bearer_metadata(token: str | None) -> list[tuple[str, str]]:
    """Call metadata carrying `token` (empty when None)."""
    return [(AUTH_METADATA_KEY, f"Bearer {token}")] if token else []


def _truncate(text: str, limit: int = MAX_STATUS_DETAILS) -> str:
    return text if len(text) <= limit else text[: limit - 15] + "... [truncated]"


async def fail(context: Any, exc: BaseException) -> None:
    """Terminate the RPC with the status for `exc` on either kind of context. Always raises.
    An unexpected error is logged with its traceback but never the request or the frames' locals
    (a request can be megabytes, and can hold what its sender would not want in a log)."""
    code, details = status_for(exc)
    details = _truncate(details)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, MeshError):
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=12))
        log.error("rpc_internal_error", error=_truncate(f"{type(exc).__name__}: {exc}", 500), traceback=_truncate(tb, 8000))
    if context is None:  # an in-process call (a Serve handle passes no gRPC context): the caller gets exc itself
        raise exc
    if hasattr(context, "abort"):
        await context.abort(code, details)  # raises grpc.aio.AbortError
    context.set_code(code)
    context.set_details(details)
    raise exc


_services: dict[type, str | None] = {}


def _service_name(cls: type) -> str | None:
    """The full proto service name a servicer class implements (from its generated base class,
    e.g. CoordinatorServiceServicer in meshrl.v1.coordinator_pb2_grpc), or None."""
    if cls not in _services:
        found = None
        for base in cls.__mro__:
            mod = base.__module__
            if mod.endswith("_pb2_grpc") and base.__name__.endswith("Servicer"):
                pb2 = sys.modules.get(mod[: -len("_grpc")])
                short = base.__name__[: -len("Servicer")]
                desc = getattr(pb2, "DESCRIPTOR", None)
                if desc is not None and short in desc.services_by_name:
                    found = desc.services_by_name[short].full_name
                    break
        _services[cls] = found
    return _services[cls]


def checked_context(servicer: Any, rpc: str, request: Any, context: Any) -> Any:
    """CONTEXT of a call that has passed auth and length checks: as is when MeshInterceptor (or a
    trusted in-process caller) already vouched for it, else checked here (behind Serve's proxy)
    and wrapped as a CallContext that carries the caller's Identity."""
    if context is None:
        return LocalContext()  # an in-process call (a Serve handle, Python): trusted
    if identity_of(context) is not None:
        return context
    from services.common.limits import process_limits

    service = _service_name(type(servicer))
    method = f"/{service or type(servicer).__name__}/{rpc}"
    auth = getattr(servicer, "auth", None) or process_authorizer()
    identity: Identity = auth.check(method, context.invocation_metadata())
    if isinstance(request, Message):
        check_lengths(request, process_limits())
    return CallContext(context, identity)


async def _checked_stream(requests: Any) -> AsyncIterator[Any]:
    from services.common.limits import process_limits

    limits = process_limits()
    async for request in requests:
        check_lengths(request, limits)
        yield request


def rpc_method(*, control: bool = False, rpc: str | None = None) -> Callable[[F], F]:
    """Wrap a servicer method `(self, request, context)` of a class derived from a generated
    `*Servicer`: the caller is authorized by the role table (services/common/auth.py) and the
    request's string lengths checked (unless MeshInterceptor did both already), then errors become
    status codes. RPC: the proto method name when the Python name differs. CONTROL is ignored (the
    role table decides; kept so older call sites import). Works for unary, server-streaming (async
    generator) and client-streaming methods."""
    del control

    def decorate(fn: F) -> F:
        name = rpc or fn.__name__
        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def stream_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
                try:
                    context = checked_context(self, name, request, context)
                    # aclosing: when the stream is cut, the handler's own `finally`/`with` blocks run
                    # now, not whenever the garbage collector gets to its generator.
                    async with contextlib.aclosing(fn(self, request, context)) as items:
                        async for item in items:
                            yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001 -- the RPC boundary: every error becomes a status
                    await fail(context, exc)

            return stream_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        async def unary_wrapper(self: Any, request: Any, context: Any) -> Any:
            try:
                checked = identity_of(context) is not None
                context = checked_context(self, name, request, context)
                if not checked and not isinstance(request, Message) and hasattr(request, "__aiter__"):
                    request = _checked_stream(request)  # client streaming behind Serve's proxy
                result = fn(self, request, context)
                if isinstance(result, Awaitable):
                    result = await result
                return result
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 -- the RPC boundary: every error becomes a status
                await fail(context, exc)

        return unary_wrapper  # type: ignore[return-value]

    return decorate


class LocalContext:
    """A stand-in servicer context for in-process calls (Serve handle calls, tests): metadata
    is given at construction; a failing call raises the original exception. TRUSTED (the default):
    the caller is inside the process or the Ray cluster (a DeploymentHandle call), which holds
    every role; False: the metadata's token is checked like a remote call's."""

    def __init__(self, metadata: Iterable[tuple[str, str]] = (), *, trusted: bool = True) -> None:
        self._metadata = tuple(metadata)
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.meshrl_identity: Identity | None = TRUSTED if trusted else None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

