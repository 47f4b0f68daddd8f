"""What the rollout worker calls to score responses: any `Scorer`.

    Scorer = Callable[[list[ScoreItem]], Awaitable[list[ScoreResult]]]

Three implementations, one behaviour (the same pipeline: built-ins, custom function, endpoints,
overlong shaping), one result per item in order, errors as MeshError subclasses:
- `RewardClient(address, application="reward")`: gRPC, through Serve's gRPC ingress (or a plain
  RewardServer / any RewardService);
- `HandleScorer(handle)`: a Ray Serve DeploymentHandle to the reward deployment (in-cluster);
- `LocalScorer(cfg)` (services/reward/local.py): the pipeline in this process, no Ray, no
  network (tests, the single-process baseline). It lives apart so that importing this module
  (the rollout does) loads no scoring code.

Errors a caller should expect: InvalidArgument (a bad item; fix the caller), Unavailable or
DeadlineExceeded (the reward service, or an external endpoint behind it, is down: keep the group
and try again later; nothing was scored as zero), anything else is a bug to surface.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from meshrl.v1 import reward_pb2, reward_pb2_grpc
from services.common import errors
from services.common.grpc_util import DEFAULT_MAX_MESSAGE_BYTES, bearer_metadata, create_channel
from services.common.security import ChannelSecurity, default_security

Scorer = Callable[[list[reward_pb2.ScoreItem]], Awaitable[list[reward_pb2.ScoreResult]]]

_ERRORS: dict[grpc.StatusCode, type[errors.MeshError]] = {
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
}


def error_from_rpc(exc: grpc.aio.AioRpcError, address: str) -> errors.MeshError:
    """The MeshError for a failed Score call (the server's message kept, the address added)."""
    code, details = exc.code(), exc.details() or ""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        field, sep, reason = details.partition(": ")
        return errors.InvalidArgument(field, reason) if sep else errors.InvalidArgument("request", details)
    cls = _ERRORS.get(code, errors.MeshError)
    return cls(f"reward service {address}: {code.name}: {details}")


def _check(results: Sequence[reward_pb2.ScoreResult], items: Sequence[reward_pb2.ScoreItem], source: str) -> None:
    if len(results) != len(items):
        raise errors.MeshError(f"{source} returned {len(results)} results for {len(items)} items")
    for r, it in zip(results, items, strict=True):
        if r.item_id != it.item_id:
            raise errors.MeshError(f"{source} returned result {r.item_id!r} where {it.item_id!r} was expected")


class RewardClient:
    """Scorer over gRPC. Retries UNAVAILABLE (a replica restarting) `max_retries` times with
    jittered backoff; each attempt has `timeout_s` (generous by default: the service may be waiting
    for a down external endpoint rather than score anything as zero). SECURITY: token and TLS
    (default: this process's role, services.common.security.use_role); TOKEN/TLS/CA_FILE override."""

    def __init__(
        self,
        address: str,
        *,
        application: str | None = None,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        token: str | None = None,
        tls: bool = False,
        ca_file: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        ingress = application is not None
        sec = security if security is not None else default_security(ingress=ingress)
        if token is not None:
            sec = sec.with_token(token)
        sec = sec.with_tls(tls=tls, ca_file=ca_file)
        self._channel = create_channel(address, max_message_bytes=max_message_bytes, security=sec, ingress=ingress)
        self.stub = reward_pb2_grpc.RewardServiceStub(self._channel)
        route = [("application", application)] if application else []
        self._md = tuple(route + bearer_metadata(sec.token))
        self._rng = random.Random()

    async def __aenter__(self) -> RewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until the service answers an (empty) Score: the channel is up and, behind Serve's
        gRPC ingress, the application's route has reached the proxy (before that the proxy
        answers NOT_FOUND). Raises TimeoutError after `timeout_s`."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise TimeoutError(f"reward service {self.address} not ready after {timeout_s}s")
            try:
                await self.stub.Score(reward_pb2.ScoreRequest(), timeout=min(left, 10.0), metadata=self._md)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise error_from_rpc(exc, self.address) from None
            await asyncio.sleep(0.1)

    async def score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        attempt = 0
        while True:
            try:
                return await self.stub.Score(request, timeout=self.timeout_s, metadata=self._md)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNAVAILABLE and attempt < self.max_retries:
                    attempt += 1
                    await asyncio.sleep(self._rng.uniform(0, self.backoff_s * 2 ** (attempt - 1)))
                    continue
                raise error_from_rpc(exc, self.address) from None

    async def __call__(self, items: list[reward_pb2.ScoreItem]) -> list[reward_pb2.ScoreResult]:
        if not items:
            return []
        resp = await self.score(reward_pb2.ScoreRequest(items=items))
        _check(resp.results, items, f"reward service {self.address}")
        return list(resp.results)


class HandleScorer:
    """Scorer over a Ray Serve DeploymentHandle to the reward deployment (deployment.py)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def __call__(self, items: list[reward_pb2.ScoreItem]) -> list[reward_pb2.ScoreResult]:
        if not items:
            return []
        try:
            resp = await self.handle.score_request.remote(reward_pb2.ScoreRequest(items=items))
        except Exception as exc:
            cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError wraps the replica's error
            if isinstance(cause, errors.MeshError):
                raise cause from None
            raise
        _check(resp.results, items, "reward deployment")
        return list(resp.results)
