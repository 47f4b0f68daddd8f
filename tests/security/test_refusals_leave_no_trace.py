"""Bounds that hold for every caller and refusals that change nothing: open services (health,
reflection) within the per-client limits, the environment's JSON nesting bound, and a refused
rendezvous check-in."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshrl.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.auth import Authorizer, Tokens
from services.common.config.security import LimitsConfig
from services.common.grpc_util import add_health_and_reflection, create_channel, create_server, set_serving

SERVICE = "meshrl.v1.CoordinatorService"


class _Echo(coordinator_pb2_grpc.CoordinatorServiceServicer):
    async def Echo(self, request, context):  # type: ignore[no-untyped-def,override]
        return coordinator_pb2.EchoResponse(payload=request.payload)


def test_open_health_streams_are_bounded_per_client() -> None:
    """Health/reflection need no token, but a client holding their streams is a client like any
    other: past max_streams_per_client it is refused, and it cannot take every server slot from
    the authenticated callers."""
    limits = LimitsConfig(max_concurrent_rpcs=4, max_concurrent_rpcs_per_client=4, max_streams_per_client=2)

    async def main() -> None:
        auth = Authorizer(Tokens(rollout="r", trainer="t", operator="o"))
        server = create_server(auth=auth, limits=limits)
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(_Echo(), server)
        health = add_health_and_reflection(server, [SERVICE])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await set_serving(health, [SERVICE])
        ch = create_channel(f"127.0.0.1:{port}")
        watches = []
        try:
            hstub = health_pb2_grpc.HealthStub(ch)
            got = []
            for _ in range(4):  # no token: health is open
                w = hstub.Watch(health_pb2.HealthCheckRequest(service=""))
                watches.append(w)
                try:
                    await asyncio.wait_for(w.read(), 5)
                    got.append("open")
                except grpc.aio.AioRpcError as exc:
                    got.append(exc.code().name)
            assert got.count("open") <= 2, got  # max_streams_per_client=2
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            reply = await stub.Echo(coordinator_pb2.EchoRequest(payload=b"x"), metadata=[("authorization", "Bearer o")],
                                    timeout=5)
            assert reply.payload == b"x"
        finally:
            for w in watches:
                w.cancel()
            await ch.close()
            await server.stop(0)

    asyncio.run(main())


def test_environment_extra_info_nesting_is_bounded_like_the_reward_services() -> None:
    """security.limits.max_json_depth bounds "environment payloads" too: a Start whose
    extra_info_json nests 900 deep (under Python's recursion limit, far past 64) is refused and
    opens no session."""
    from meshrl.v1 import common_pb2, environment_pb2
    from services.common.errors import InvalidArgument
    from services.common.grpc_util import LocalContext
    from services.environment.base import Environment, StartResult
    from services.environment.core import SessionTable
    from services.environment.servicer import EnvironmentServicer

    class Env(Environment):
        name = "t"

        async def start(self, session_id, prompt, **kw):  # type: ignore[no-untyped-def,override]
            return StartResult()

        async def step(self, *a, **kw):  # type: ignore[no-untyped-def,override]
            raise AssertionError("this test never steps a session")

        async def close(self, session_id):  # type: ignore[no-untyped-def,override]
            raise AssertionError("a refused Start opens no session to close")

    async def main() -> None:
        table = SessionTable(Env())
        servicer = EnvironmentServicer(table)
        deep = '{"a":' + "[" * 900 + "]" * 900 + "}"
        req = environment_pb2.StartRequest(session_id="s", prompt=common_pb2.Prompt(prompt_id="p", extra_info_json=deep))
        with pytest.raises(InvalidArgument, match="extra_info_json"):
            await servicer.Start(req, LocalContext())
        assert table.open_sessions == 0

    asyncio.run(main())


def test_a_refused_receiver_check_in_leaves_the_rendezvous_board_as_it_was() -> None:
    """A receiver check-in refused for asking an older version than the sender broadcasts
    (FAILED_PRECONDITION) must not first retire the group's generation (its failed_generation)
    nor mark the member as heard from: check, then change."""
    from services.common.errors import FailedPrecondition
    from services.param_server.rendezvous import RendezvousBoard

    board = RendezvousBoard(replace_after_s=60.0, clock=lambda: 100.0)
    kw = dict(world_size=2, backend="nccl", master_address="10.0.0.1", master_port=29500)
    board.sender_check_in("g", "sender", policy_version=5, **kw)  # type: ignore[arg-type]
    got, _ = board.receiver_check_in("g", "r1", backend="nccl", world_size=2, policy_version=5)
    assert got is not None
    gen = board.group("g").generation  # type: ignore[union-attr]
    seen_before = dict(board._seen)
    with pytest.raises(FailedPrecondition):
        board.receiver_check_in("g", "intruder", backend="nccl", world_size=2, policy_version=4, failed_generation=gen)
    state = board.group("g")
    assert state is not None and state.generation == gen, "a refused check-in retired the generation"
    assert state.ranks == {"r1": 1}
    with pytest.raises(FailedPrecondition):
        board.receiver_check_in("g", "r1", backend="nccl", world_size=2, policy_version=4)
    assert board._seen == seen_before
