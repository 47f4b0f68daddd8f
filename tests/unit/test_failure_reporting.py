"""Failures reach a person on one line: `first_cause` unwraps what Ray wraps, the RPC error
boundary works without a gRPC context (Serve handle calls), and a replica's failed groups reach
GetStatus through ReturnLeases `error`, halting leasing once they repeat."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from ray.exceptions import RayTaskError

from meshrl.v1 import common_pb2, coordinator_pb2
from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable, first_cause, transient
from services.common.grpc_util import LocalContext, rpc_method
from services.coordinator.servicer import CoordinatorServicer
from tests.unit.test_coordinator_liveness import _core


def test_first_cause_is_the_remote_exception_on_one_line() -> None:
    cause = InvalidArgument("data.max_prompt_length", "prompt train:10 has 187 tokens > 16;\nraise it")
    wrapped = RayTaskError("Generate", "Traceback (most recent call last):\n  File ...\n" * 20, cause)
    wrapped = wrapped.as_instanceof_cause()
    assert first_cause(wrapped) == "InvalidArgument: data.max_prompt_length: prompt train:10 has 187 tokens > 16; raise it"
    assert first_cause(RuntimeError("x" * 1000), limit=50) == "RuntimeError: " + "x" * 33 + "..."
    assert first_cause(KeyError()) == "KeyError"

    class _RpcError(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "connection refused"

    assert first_cause(_RpcError()) == "UNAVAILABLE: connection refused"


def test_the_rpc_boundary_raises_the_real_error_when_called_without_a_context() -> None:
    """A Serve handle call (validation's Rollout.Generate) passes grpc_context=None: the caller
    must get the servicer's own error, never an AttributeError from the error path."""

    class Servicer:
        @rpc_method()
        async def Generate(self, request: object, context: object) -> None:
            raise InvalidArgument("prompt", "187 tokens > data.max_prompt_length=16")

    with pytest.raises(InvalidArgument, match="187 tokens"):
        asyncio.run(Servicer().Generate(None, None))
    ctx = LocalContext()
    with pytest.raises(InvalidArgument):
        asyncio.run(Servicer().Generate(None, ctx))
    assert ctx.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_failed_groups_reach_get_status_and_halt_leasing(tmp_path: Path) -> None:
    core = _core(tmp_path / "l.db", max_failures=3)
    clock = [0.0]
    servicer = CoordinatorServicer(core, sampling=common_pb2.SamplingParams(n=2), clock=lambda: clock[0])

    async def scenario() -> coordinator_pb2.GetStatusResponse:
        ctx = LocalContext()
        grant = await servicer.LeasePrompts(coordinator_pb2.LeasePromptsRequest(replica_id="r", max_groups=4), ctx)
        ids = [x.lease_id for x in grant.leases]
        error = "InvalidArgument: reward endpoint e1: results[0].item_id is '', expected 'g0/0'"
        resp = await servicer.ReturnLeases(coordinator_pb2.ReturnLeasesRequest(replica_id="r", lease_ids=ids[:3],
                                                                               error=error), ctx)
        assert resp.returned == 3
        # The same return sent again (its first reply lost) returns nothing and counts nothing.
        again_resp = await servicer.ReturnLeases(coordinator_pb2.ReturnLeasesRequest(
            replica_id="r", lease_ids=ids[:3], error=error), ctx)
        assert again_resp.returned == 0
        # A drain's return carries no error and counts nothing.
        await servicer.ReturnLeases(coordinator_pb2.ReturnLeasesRequest(replica_id="r", lease_ids=ids[3:]), ctx)
        again = await servicer.LeasePrompts(coordinator_pb2.LeasePromptsRequest(replica_id="r", max_groups=4), ctx)
        assert not again.leases and again.limit == coordinator_pb2.LEASE_LIMIT_PAUSED
        return await servicer.GetStatus(coordinator_pb2.GetStatusRequest(), ctx)

    status = asyncio.run(scenario())
    assert "3 prompt groups failed in a row" in status.halted_reason and "item_id is ''" in status.halted_reason
    assert [(f.source, f.count) for f in status.failures] == [("r", 3)]
    assert status.totals.leases_returned == 4 and status.totals.in_flight == 0


def test_transient_failures_are_those_of_the_service_not_of_the_request() -> None:
    def err(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)

    assert transient(err(grpc.StatusCode.UNAVAILABLE)) and transient(err(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert transient(Unavailable("PublishWeights: stream removed")) and transient(DeadlineExceeded("slow"))
    # Serve's proxy when the replica serving the call died: INTERNAL, naming the dead actor.
    assert transient(err(grpc.StatusCode.INTERNAL, "The actor died unexpectedly before finishing this task."))
    assert not transient(err(grpc.StatusCode.INTERNAL, "KeyError: 'x'"))
    assert not transient(err(grpc.StatusCode.INVALID_ARGUMENT, "groups[0].lease_id: unknown"))
    assert not transient(InvalidArgument("f", "bad")) and not transient(RuntimeError("Unavailable"))


def test_a_replica_constructor_failure_is_logged_as_its_remote_cause_on_one_line() -> None:
    """A trainer replica whose rank actors fail to build their engine (a model path that is not
    there, a checkpoint that does not load) raises the RayTaskError Ray wraps the rank's error in:
    its text is the rank's whole remote traceback, the error last. log_init_errors logged that
    text, and `meshrl train` reports the logged error cut at 500 characters (first_cause), so the
    user read a traceback's first lines and not the error."""
    from structlog.testing import capture_logs

    from services.common.serve_util import log_init_errors

    cause = OSError("actor_rollout_ref.model.path: /models/qwen3-8b has no config.json")
    traceback = "Traceback (most recent call last):\n" + '  File "/site-packages/x.py", line 1, in f\n    g()\n' * 20
    wrapped = RayTaskError("TrainWorker.init_engine", traceback + "OSError: ...", cause).as_instanceof_cause()

    class Deployment:
        @log_init_errors
        async def __init__(self) -> None:
            raise wrapped

    with capture_logs() as logs, pytest.raises(RayTaskError):
        asyncio.run(Deployment.__init__(object.__new__(Deployment)))  # Serve awaits the async constructor
    (rec,) = [r for r in logs if r["event"] == "replica_init_failed"]
    assert rec["error"] == f"OSError: {cause}", rec["error"][:300]
