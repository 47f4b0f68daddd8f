"""CoordinatorClient: the Python face of CoordinatorService (rollout, trainer, operator, CLI).

Every call carries a deadline and the caller's bearer token (`authorization: Bearer <token>`; the
role table in services/common/auth.py says which role each RPC needs). Under Ray Serve's gRPC
ingress the `application` metadata routes the call; it is sent when `application` is given, and
then the channel is plaintext unless TLS is asked for explicitly (Serve's proxy has no TLS).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from meshrl.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.common.grpc_util import DEFAULT_MAX_MESSAGE_BYTES, bearer_metadata, create_channel
from services.common.security import ChannelSecurity, default_security

from . import wire


class CoordinatorClient:
    """Async client. Use as `async with CoordinatorClient(addr) as c: await c.status()`.

    SECURITY: token and TLS (default: this process's, services.common.security.use_role); TOKEN,
    TLS and CA_FILE override it."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        application: str | None = None,
        timeout_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: bool = False,
        ca_file: str | None = None,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        ingress = application is not None
        sec = security if security is not None else default_security(ingress=ingress)
        if token is not None:
            sec = sec.with_token(token)
        sec = sec.with_tls(tls=tls, ca_file=ca_file)
        self._channel = create_channel(address, max_message_bytes=max_message_bytes, security=sec, ingress=ingress)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        self._submit_raw = self._channel.unary_unary(
            f"/{wire.SERVICE}/SubmitGroups", request_serializer=None,
            response_deserializer=coordinator_pb2.SubmitGroupsResponse.FromString,
        )
        route = [("application", application)] if application else []
        self._md = tuple(route + bearer_metadata(sec.token))

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the channel connects (raises TimeoutError after timeout_s)."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout=timeout_s)

    def _kw(self, timeout_s: float | None = None) -> dict[str, Any]:
        return {"metadata": self._md, "timeout": timeout_s or self.timeout_s}

    # ---- rollout side ----------------------------------------------------------------------

    async def lease(self, replica_id: str, max_groups: int) -> coordinator_pb2.LeasePromptsResponse:
        req = coordinator_pb2.LeasePromptsRequest(
            replica_id=replica_id, max_groups=max_groups, max_reply_bytes=self.max_message_bytes
        )
        return await self.stub.LeasePrompts(req, **self._kw())

    async def renew(self, replica_id: str, lease_ids: Sequence[str]) -> coordinator_pb2.RenewLeasesResponse:
        req = coordinator_pb2.RenewLeasesRequest(replica_id=replica_id, lease_ids=list(lease_ids))
        return await self.stub.RenewLeases(req, **self._kw())

    async def return_leases(self, replica_id: str, lease_ids: Sequence[str], error: str = "") -> int:
        """ERROR: why their groups failed (empty for a drain); the coordinator reports it."""
        req = coordinator_pb2.ReturnLeasesRequest(replica_id=replica_id, lease_ids=list(lease_ids), error=error)
        return (await self.stub.ReturnLeases(req, **self._kw())).returned

    async def submit(
        self, replica_id: str, groups: Sequence[common_pb2.TrajectoryGroup]
    ) -> coordinator_pb2.SubmitGroupsResponse:
        # Serialized once, straight into the request (no copy of every group into a new message).
        return await self._submit_raw(wire.submit_request_bytes(replica_id, groups), **self._kw())

    async def watch_versions(self, replica_id: str) -> AsyncIterator[coordinator_pb2.WatchVersionsResponse]:
        call = self.stub.WatchVersions(coordinator_pb2.WatchVersionsRequest(replica_id=replica_id), metadata=self._md)
        async for item in call:
            yield item

    # ---- trainer side ----------------------------------------------------------------------

    async def fetch_batch(
        self,
        trainer_id: str,
        step: int,
        num_groups: int,
        *,
        timeout_ms: int = 10_000,
        filtered_lease_ids: Sequence[str] = (),
        train_version: int | None = None,
    ) -> coordinator_pb2.FetchBatchResponse:
        req = coordinator_pb2.FetchBatchRequest(
            trainer_id=trainer_id, step=step, num_groups=num_groups, timeout_ms=timeout_ms,
            filtered_lease_ids=list(filtered_lease_ids), train_version=train_version,
            max_reply_bytes=self.max_message_bytes,
        )
        return await self.stub.FetchBatch(req, **self._kw(timeout_s=self.timeout_s + timeout_ms / 1000.0))

    async def commit_version(self, trainer_id: str, weights: common_pb2.WeightsRef) -> coordinator_pb2.CommitVersionResponse:
        req = coordinator_pb2.CommitVersionRequest(trainer_id=trainer_id, weights=weights)
        return await self.stub.CommitVersion(req, **self._kw())

    async def report_checkpoint(self, trainer_id: str, step: int, policy_version: int, path: str) -> None:
        req = coordinator_pb2.ReportCheckpointRequest(trainer_id=trainer_id, step=step, policy_version=policy_version, path=path)
        await self.stub.ReportCheckpoint(req, **self._kw())

    async def resume_trainer(self, trainer_id: str, checkpoint_step: int) -> coordinator_pb2.ResumeTrainerResponse:
        req = coordinator_pb2.ResumeTrainerRequest(trainer_id=trainer_id, checkpoint_step=checkpoint_step)
        return await self.stub.ResumeTrainer(req, **self._kw())

    # ---- operator --------------------------------------------------------------------------

    async def status(self) -> coordinator_pb2.GetStatusResponse:
        return await self.stub.GetStatus(coordinator_pb2.GetStatusRequest(), **self._kw())

    async def pause(self) -> None:
        await self.stub.Pause(coordinator_pb2.PauseRequest(), **self._kw())

    async def resume(self) -> None:
        await self.stub.Resume(coordinator_pb2.ResumeRequest(), **self._kw())

    async def set_staleness(self, threshold: float) -> int:
        req = coordinator_pb2.SetStalenessRequest(staleness_threshold=threshold)
        return (await self.stub.SetStaleness(req, **self._kw())).max_required_samples

    async def request_checkpoint(self) -> None:
        await self.stub.RequestCheckpoint(coordinator_pb2.RequestCheckpointRequest(), **self._kw())

    async def stop(self) -> None:
        await self.stub.Stop(coordinator_pb2.StopRequest(), **self._kw())

    async def echo(self, payload: bytes) -> bytes:
        return (await self.stub.Echo(coordinator_pb2.EchoRequest(payload=payload), **self._kw())).payload
