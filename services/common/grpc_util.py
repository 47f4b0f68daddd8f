"""gRPC edges shared by every service: server and channel factories, the error boundary, auth.

Error boundary. Servicer methods are wrapped with `rpc_method`: a MeshError (or any exception)
becomes a status code from `errors.status_for`. Under a plain grpc.aio server the context has
`abort`; under Ray Serve's gRPC proxy it is a RayServegRPCContext, where a raised exception turns
into INTERNAL unless the code was set on the context first (Ray >= 2.55), so we set code and
details, then raise. Either way the client sees the same code and message.

Auth. Control RPCs need `authorization: Bearer <token>` metadata. `check_token` is the check;
`TokenInterceptor` applies it on plain servers, `rpc_method(control=True)` inside Serve (the Serve
proxy accepts no interceptors).
"""

from __future__ import annotations

import functools
import hmac
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from services.common.errors import MeshError, Unauthenticated, status_for
from services.common.logging import get_logger

log = get_logger(__name__)

MiB = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB
AUTH_METADATA_KEY = "authorization"

F = TypeVar("F", bound=Callable[..., Any])


def message_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel/server options: symmetric size limits and keepalive for long streams."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def create_channel(
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: bool = False,
    root_certificates: bytes | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel with meshrl's limits. Pass deadlines per call (`timeout=`)."""
    options = message_options(max_message_bytes)
    if tls:
        creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        return grpc.aio.secure_channel(address, creds, options=options)
    return grpc.aio.insecure_channel(address, options=options)


def create_sync_channel(address: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A blocking channel (CLI, tests). Never use one inside an asyncio server's loop."""
    return grpc.insecure_channel(address, options=message_options(max_message_bytes))


def create_server(
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    maximum_concurrent_rpcs: int | None = None,
) -> grpc.aio.Server:
    # SO_REUSEPORT off (grpc turns it on by default): a second server on a port in use must fail
    # to bind, not silently share the port and receive half of another run's connections.
    return grpc.aio.server(
        options=[*message_options(max_message_bytes), ("grpc.so_reuseport", 0)],
        interceptors=list(interceptors),
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
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
        from grpc_reflection.v1alpha import reflection

        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    except ImportError:
        log.info("grpc_reflection_unavailable", hint="pip install grpcio-reflection")
    return health


async def set_serving(health: Any, service_names: Iterable[str]) -> None:
    if health is None:
        return
    from grpc_health.v1 import health_pb2

    for name in ["", *service_names]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)


def bearer_metadata(token: str | None) -> list[tuple[str, str]]:
    """Call metadata carrying `token` (empty when None)."""
    return [(AUTH_METADATA_KEY, f"Bearer {token}")] if token else []


def _metadata_value(metadata: Iterable[Any] | None, key: str) -> str | None:
    for item in metadata or ():
        k, v = (item.key, item.value) if hasattr(item, "key") else item
        if k.lower() == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def check_token(metadata: Iterable[Any] | None, expected: str | None) -> None:
    """Raise Unauthenticated unless the metadata carries `Bearer <expected>`. No token
    configured: everything passes."""
    if not expected:
        return
    got = _metadata_value(metadata, AUTH_METADATA_KEY)
    if got is None:
        raise Unauthenticated("this RPC needs a token: pass --token or set MESHRL_TOKEN")
    scheme, _, value = got.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.encode(), expected.encode()):
        raise Unauthenticated("wrong token")


async def fail(context: Any, exc: BaseException) -> None:
    """Terminate the RPC with the status for `exc` on either kind of context. Always raises."""
    code, details = status_for(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, MeshError):
        log.error("rpc_internal_error", exc_info=exc)
    if context is None:  # an in-process call (a Serve handle passes no gRPC context): the caller gets exc itself
        raise exc
    if hasattr(context, "abort"):
        await context.abort(code, details)  # raises grpc.aio.AbortError
    context.set_code(code)
    context.set_details(details)
    raise exc


def rpc_method(*, control: bool = False) -> Callable[[F], F]:
    """Wrap a servicer method `(self, request, context)`: errors become status codes; with
    control=True the caller must present `self.token`. Works for unary and server-streaming
    (async generator) methods."""

    def decorate(fn: F) -> F:
        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def stream_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
                try:
                    if control:
                        check_token(context.invocation_metadata(), getattr(self, "token", None))
                    async for item in fn(self, request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001 -- the RPC boundary: every error becomes a status
                    await fail(context, exc)

            return stream_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        async def unary_wrapper(self: Any, request: Any, context: Any) -> Any:
            try:
                if control:
                    check_token(context.invocation_metadata(), getattr(self, "token", None))
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


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls to `protected` methods (full names "/pkg.Service/Method") without the token.
    For plain grpc.aio servers; under Serve use rpc_method(control=True)."""

    def __init__(self, token: str | None, protected: Iterable[str]) -> None:
        self._token = token
        self._protected = frozenset(protected)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not self._token or handler_call_details.method not in self._protected:
            return await continuation(handler_call_details)
        try:
            check_token(handler_call_details.invocation_metadata, self._token)
        except Unauthenticated as exc:
            return _deny(str(exc))
        return await continuation(handler_call_details)


def _deny(details: str) -> grpc.RpcMethodHandler:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    return grpc.unary_unary_rpc_method_handler(abort)


class LocalContext:
    """A stand-in servicer context for in-process calls (Serve handle calls, tests): metadata
    is given at construction; a failing call raises the original exception."""

    def __init__(self, metadata: Iterable[tuple[str, str]] = ()) -> None:
        self._metadata = tuple(metadata)
        self._code: grpc.StatusCode | None = None
        self._details = ""

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
