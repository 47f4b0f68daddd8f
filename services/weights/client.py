"""ParamServerClient: the Python face of ParamServerService (publishers, fetchers, CLI, tests).

Every call carries a deadline. Weight chunks go through the zero-copy codec (wire.py). Under Ray
Serve's gRPC ingress the `application` metadata routes the call. gRPC errors come back as the
matching MeshError (DeadlineExceeded, DataLoss, NotFound, ...) with the server's message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, NoReturn

import grpc
import grpc.aio

from meshrl.v1 import common_pb2, param_server_pb2_grpc
from meshrl.v1 import param_server_pb2 as pb
from services.common import errors
from services.common.grpc_util import DEFAULT_MAX_MESSAGE_BYTES, bearer_metadata, create_channel
from services.common.security import ChannelSecurity, default_security

from . import convert, wire
from .layout import Manifest

_BY_CODE: dict[grpc.StatusCode, type[errors.MeshError]] = {
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.CANCELLED: errors.Unavailable,
}


def raise_rpc_error(exc: grpc.aio.AioRpcError, what: str) -> NoReturn:
    """Re-raise a gRPC failure as the MeshError of its status code."""
    code = exc.code()
    details = f"{what}: {code.name}: {exc.details()}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise errors.InvalidArgument(what, exc.details() or "") from exc
    cls = _BY_CODE.get(code, errors.MeshError)
    raise cls(details) from exc


class ParamServerClient:
    """Async client. Use as `async with ParamServerClient(addr) as c: await c.list_versions()`.
    SECURITY: token and TLS (default: this process's role, services.common.security.use_role)."""

    def __init__(
        self,
        address: str,
        *,
        application: str | None = None,
        timeout_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self._channel: grpc.aio.Channel | None = None
        self._ingress = application is not None
        self.security = security if security is not None else default_security(ingress=self._ingress)
        route = [("application", application)] if application else []
        self._md: tuple[tuple[str, str], ...] = tuple(route + bearer_metadata(self.security.token))

    def _open(self) -> grpc.aio.Channel:
        # Opened on first use, inside the caller's event loop (a client may be built outside one).
        if self._channel is None:
            self._channel = create_channel(self.address, max_message_bytes=self.max_message_bytes,
                                           security=self.security, ingress=self._ingress)
            self._stub = param_server_pb2_grpc.ParamServerServiceStub(self._channel)
            self._publish = wire.publish_callable(self._channel)
            self._fetch = wire.fetch_callable(self._channel)
        return self._channel

    @property
    def stub(self) -> param_server_pb2_grpc.ParamServerServiceStub:
        self._open()
        return self._stub

    async def __aenter__(self) -> ParamServerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        await asyncio.wait_for(self._open().channel_ready(), timeout=timeout_s)

    def _kw(self, timeout_s: float | None) -> dict[str, Any]:
        return {"metadata": self._md, "timeout": timeout_s if timeout_s is not None else self.timeout_s}

    # ---- bytes ------------------------------------------------------------------------------------

    async def publish(self, items: AsyncIterable[Any], *, timeout_s: float) -> pb.PublishWeightsResponse:
        """Stream PublishWeightsRequest items (protos or wire.RawChunk for chunks)."""
        self._open()
        try:
            return await self._publish(items, **self._kw(timeout_s))  # type: ignore[no-any-return]
        except grpc.aio.AioRpcError as exc:
            raise_rpc_error(exc, "PublishWeights")

    def fetch(self, request: pb.FetchWeightsRequest, *, timeout_s: float) -> grpc.aio.UnaryStreamCall:
        """The raw FetchWeights call: iterate it for a FetchWeightsResponse (manifest) then RawChunks."""
        self._open()
        return self._fetch(request, **self._kw(timeout_s))  # type: ignore[no-any-return]

    async def register(self, manifest: Manifest, *, timeout_s: float | None = None) -> pb.PublishWeightsResponse:
        """Register a version whose bytes travel another way (manifest.transports names it)."""

        async def one() -> AsyncIterator[pb.PublishWeightsRequest]:
            yield pb.PublishWeightsRequest(manifest=convert.manifest_to_proto(manifest))

        return await self.publish(one(), timeout_s=timeout_s or self.timeout_s)

    # ---- metadata ---------------------------------------------------------------------------------

    async def get_manifest(self, policy_version: int = -1, *, timeout_s: float | None = None) -> Manifest:
        """The manifest of a version; negative = the newest complete one."""
        try:
            resp = await self.stub.GetManifest(pb.GetManifestRequest(policy_version=policy_version), **self._kw(timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise_rpc_error(exc, "GetManifest")
        return convert.manifest_from_proto(resp.manifest)

    async def newest_ref(self, *, timeout_s: float | None = None) -> common_pb2.WeightsRef:
        """A WeightsRef to the newest complete version (a replica joining a running job)."""
        m = await self.get_manifest(-1, timeout_s=timeout_s)
        return convert.weights_ref(m, self.address)

    async def list_versions(self, *, timeout_s: float | None = None) -> list[pb.VersionInfo]:
        try:
            resp = await self.stub.ListVersions(pb.ListVersionsRequest(), **self._kw(timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise_rpc_error(exc, "ListVersions")
        return list(resp.versions)

    async def acquire(self, consumer_id: str, policy_version: int, *, timeout_s: float | None = None) -> Manifest:
        req = pb.AcquireVersionRequest(consumer_id=consumer_id, policy_version=policy_version)
        try:
            resp = await self.stub.AcquireVersion(req, **self._kw(timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise_rpc_error(exc, "AcquireVersion")
        return convert.manifest_from_proto(resp.manifest)

    async def release(self, consumer_id: str, policy_version: int, *, timeout_s: float | None = None) -> None:
        req = pb.ReleaseVersionRequest(consumer_id=consumer_id, policy_version=policy_version)
        try:
            await self.stub.ReleaseVersion(req, **self._kw(timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise_rpc_error(exc, "ReleaseVersion")

    async def rendezvous(self, request: pb.RendezvousRequest, *, timeout_s: float) -> pb.RendezvousResponse:
        try:
            return await self.stub.Rendezvous(request, **self._kw(timeout_s))  # type: ignore[no-any-return]
        except grpc.aio.AioRpcError as exc:
            raise_rpc_error(exc, f"Rendezvous(group={request.group!r}, role={request.role})")
