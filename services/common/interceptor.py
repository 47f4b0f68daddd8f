"""The front door of every plain grpc.aio meshrl server: who is calling, may they, is the request
even a message, and is the client within its bounds — all before a servicer sees it.

    server = grpc.aio.server(interceptors=[MeshInterceptor(auth, limits=..., limiter=..., stall_timeout_s=120)])

Per call, in order:
1. auth (services.common.auth): UNAUTHENTICATED / PERMISSION_DENIED; a refused request is never
   decoded. Calls to non-meshrl services (grpc.health, reflection) pass untouched;
2. decode: an undecodable request is INVALID_ARGUMENT with one rate-limited log line (grpc's own
   path answers UNKNOWN and logs a traceback per call);
3. string lengths by field kind (services.common.limits): INVALID_ARGUMENT naming the field;
4. per-client concurrency (RPCs and streams per identity): RESOURCE_EXHAUSTED;
5. the servicer runs with a `CallContext` (the real context plus the caller's Identity);
6. server streams are written with a deadline per message: a reader that takes nothing for
   `stall_timeout_s` is cut with DEADLINE_EXCEEDED and the servicer's generator is closed, so
   whatever it held (a version pinned by FetchWeights) is released.

Behind Ray Serve's gRPC proxy, which takes no interceptors, grpc_util.rpc_method does 1 and 3
with the same Authorizer and Limits; the proxy decodes requests itself.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import grpc
import grpc.aio

from .auth import Authorizer, Identity
from .errors import InvalidArgument, MeshError, PermissionDenied, ResourceExhausted
from .limits import ClientLimiter, Limits, RateLimitedLog, check_lengths


class CallContext:
    """A servicer context of a checked call: every attribute of the real context, plus
    `meshrl_identity` (who is calling). Passed to servicers instead of the real context."""

    __slots__ = ("_ctx", "meshrl_identity")

    def __init__(self, ctx: Any, identity: Identity) -> None:
        self._ctx = ctx
        self.meshrl_identity = identity

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    @property
    def raw(self) -> Any:
        return self._ctx


def identity_of(context: Any) -> Identity | None:
    """The Identity a checked call carries (None: the call was not checked)."""
    return getattr(context, "meshrl_identity", None)


def require_role(context: Any, role: str, what: str) -> None:
    """Inside a handler: only ROLE may do WHAT (PERMISSION_DENIED otherwise). With auth off every
    caller holds every role."""
    ident = identity_of(context)
    if ident is None or role not in ident.roles:
        held = "none (an unchecked call)" if ident is None else " or ".join(sorted(ident.roles))
        raise PermissionDenied(f"{what} needs a token of role {role}; the token presented is of role {held}")


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def peer_host(peer: str) -> str:
    """"ipv4:10.0.0.5:51234" -> "10.0.0.5"; "ipv6:[::1]:5" -> "::1"; anything else as is."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rpartition(":")[0]
        return host.strip("[]")
    return peer


def peer_subject(context: Any) -> str:
    """The common name of an mTLS client certificate ("" without one)."""
    try:
        ac = context.auth_context() or {}
    except Exception:  # noqa: BLE001 -- no auth context on this transport
        return ""
    names = ac.get("x509_common_name") or ac.get("x509_subject") or []
    return names[0].decode(errors="replace") if names else ""


def _abort_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of HANDLER's kind that refuses at once, without decoding the request."""

    async def refuse(request: Any, context: Any) -> None:
        await context.abort(code, details)

    async def refuse_stream(request: Any, context: Any) -> AsyncIterator[Any]:
        await context.abort(code, details)
        yield  # pragma: no cover - abort raises

    raw = {"request_deserializer": None}
    if handler.unary_unary is not None:
        return handler._replace(unary_unary=refuse, **raw)
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=refuse_stream, **raw)
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=refuse, **raw)
    return handler._replace(stream_stream=refuse_stream, **raw)


class MeshInterceptor(grpc.aio.ServerInterceptor):
    """See the module docstring. One per server; use from that server's event loop."""

    def __init__(
        self,
        auth: Authorizer,
        *,
        limits: Limits | None = None,
        limiter: ClientLimiter | None = None,
        stall_timeout_s: float | None = 120.0,
    ) -> None:
        self.auth = auth
        self.limits = limits or Limits()
        self.limiter = limiter
        self.stall_timeout_s = stall_timeout_s
        self.undecodable = RateLimitedLog("request_undecodable")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None:
            return handler  # unknown method (UNIMPLEMENTED)
        if self.auth.allowed(method) is None:
            # not meshrl's (health, reflection): open to anyone, but within the per-client bounds,
            # or an anonymous client holding Watch streams takes every slot of the server
            return self._limit_only(handler) if self.limiter is not None else handler
        try:
            identity = self.auth.check(method, details.invocation_metadata)
        except MeshError as exc:
            return _abort_handler(handler, exc.code, str(exc))
        return self._wrap(handler, method, identity)

    def _limit_only(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """HANDLER (of an open, non-meshrl service) counted against its caller's per-client bounds."""
        anonymous = Identity(roles=frozenset())
        streaming = handler.unary_unary is None

        def wrap(behavior: Any, streams_out: bool) -> Any:
            async def limited(request: Any, context: Any) -> Any:
                _, release = await self._enter(context, anonymous, streaming=streaming)
                try:
                    result = behavior(request, context)
                    if streams_out:
                        await self._drive(result, context)
                        return None
                    return await result if inspect.isawaitable(result) else result
                finally:
                    release()

            return limited

        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: wrap(behavior, kind.endswith("_stream"))})
        return handler

    # ---- the wrapped handler -----------------------------------------------------------------------

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str, identity: Identity) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer

        def safe_deserialize(raw: bytes) -> Any:
            try:
                return deserialize(raw) if deserialize is not None else raw
            except Exception as exc:  # noqa: BLE001 -- any decode failure is the caller's malformed request
                return _Undecodable(exc)

        kw: dict[str, Any] = {"request_deserializer": safe_deserialize}
        if handler.unary_unary is not None:
            kw["unary_unary"] = self._unary_unary(handler.unary_unary, method, identity)
        elif handler.unary_stream is not None:
            kw["unary_stream"] = self._unary_stream(handler.unary_stream, method, identity)
        elif handler.stream_unary is not None:
            kw["stream_unary"] = self._stream_unary(handler.stream_unary, method, identity)
        else:
            kw["stream_stream"] = self._stream_stream(handler.stream_stream, method, identity)
        return handler._replace(**kw)

    def _check(self, request: Any, method: str) -> None:
        if isinstance(request, _Undecodable):
            self.undecodable(method=method, error=f"{type(request.error).__name__}: {str(request.error)[:200]}")
            raise InvalidArgument("request", f"not a valid {method.rsplit('/', 1)[-1]} request message "
                                  f"({type(request.error).__name__}); send the protobuf message the method takes")
        check_lengths(request, self.limits)

    async def _enter(self, context: Any, identity: Identity, streaming: bool) -> tuple[CallContext, Callable[[], None]]:
        ident = replace(identity, peer=peer_host(context.peer() or ""), subject=peer_subject(context))
        release: Callable[[], None] = _noop
        if self.limiter is not None:
            try:
                release = self.limiter.acquire(ident.key, streaming=streaming)
            except ResourceExhausted as exc:
                await context.abort(exc.code, str(exc))
        return CallContext(context, ident), release

    async def _refuse(self, context: Any, exc: MeshError) -> None:
        await context.abort(exc.code, str(exc))

    def _unary_unary(self, behavior: Any, method: str, identity: Identity) -> Any:
        async def unary_unary(request: Any, context: Any) -> Any:
            try:
                self._check(request, method)
            except MeshError as exc:
                await self._refuse(context, exc)
            ctx, release = await self._enter(context, identity, streaming=False)
            try:
                result = behavior(request, ctx)
                return await result if inspect.isawaitable(result) else result
            finally:
                release()

        return unary_unary

    def _unary_stream(self, behavior: Any, method: str, identity: Identity) -> Any:
        async def unary_stream(request: Any, context: Any) -> None:
            try:
                self._check(request, method)
            except MeshError as exc:
                await self._refuse(context, exc)
            ctx, release = await self._enter(context, identity, streaming=True)
            try:
                await self._drive(behavior(request, ctx), context)
            finally:
                release()

        return unary_stream

    def _stream_unary(self, behavior: Any, method: str, identity: Identity) -> Any:
        async def stream_unary(request_iterator: Any, context: Any) -> Any:
            ctx, release = await self._enter(context, identity, streaming=True)
            try:
                result = behavior(self._checked(request_iterator, method), ctx)
                return await result if inspect.isawaitable(result) else result
            finally:
                release()

        return stream_unary

    def _stream_stream(self, behavior: Any, method: str, identity: Identity) -> Any:
        async def stream_stream(request_iterator: Any, context: Any) -> None:
            ctx, release = await self._enter(context, identity, streaming=True)
            try:
                await self._drive(behavior(self._checked(request_iterator, method), ctx), context)
            finally:
                release()

        return stream_stream

    async def _checked(self, requests: Any, method: str) -> AsyncIterator[Any]:
        async for request in requests:
            self._check(request, method)  # raised inside the servicer: its rpc_method maps it
            yield request

    async def _drive(self, out: Any, context: Any) -> None:
        """Write a server stream's messages, each within `stall_timeout_s`. A reader that takes
        nothing for that long gets no more: the generator is closed at once (its `finally`/`with`
        blocks run, releasing what it holds), and the stream ends with DEADLINE_EXCEEDED once the
        message already handed to gRPC leaves (the reader resumes) or the call ends (its deadline,
        a disconnect). A message handed to gRPC cannot be taken back, so the handler waits for it
        rather than abandoning it, which would leave the call with no status."""
        if not inspect.isasyncgen(out):
            if inspect.isawaitable(out):
                await out  # a handler that writes through context.write itself
            return
        try:
            async for item in out:
                write = asyncio.ensure_future(context.write(item))
                done, _ = await asyncio.wait({write}, timeout=self.stall_timeout_s)
                if done:
                    write.result()
                    continue
                await out.aclose()
                await write
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the client read nothing for {self.stall_timeout_s:g} s "
                    "(security.limits.stream_stall_timeout_s); the stream was cut",
                )
        finally:
            await out.aclose()


def _noop() -> None:
    return None

