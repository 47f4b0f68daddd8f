"""TLS and mTLS on every plain server with every meshrl client, keepalive that servers and clients
agree on, reflection v1 and v1alpha, the exposed-server warning, and what reaches the logs."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from meshrl.v1 import coordinator_pb2, coordinator_pb2_grpc, reward_pb2
from services.common.auth import OPERATOR, ROLLOUT, Authorizer, Tokens
from services.common.config import load_config
from services.common.errors import Unavailable
from services.common.grpc_util import (
    Keepalive,
    add_health_and_reflection,
    bind_port,
    create_channel,
    create_server,
    message_options,
    rpc_method,
)
from services.common.security import ChannelSecurity, client_security
from services.coordinator.client import CoordinatorClient
from services.coordinator.server import CoordinatorServer
from services.param_server.server import ParamServerServer
from services.reward.client import RewardClient
from services.reward.server import RewardServer
from services.weights.client import ParamServerClient

from .certs import Certs
from .mesh import OVERRIDES, TOKENS

TLS_ERRORS = (grpc.aio.AioRpcError, Unavailable)


def _tls_overrides(certs: Certs, *, mtls: bool) -> list[str]:
    out = [f"security.tls.cert_file={certs.server_cert}", f"security.tls.key_file={certs.server_key}",
           f"security.tls.ca_file={certs.ca}", "security.tls.server_name=localhost"]
    if mtls:
        out += [f"security.tls.client_ca_file={certs.ca}", f"security.tls.client_cert_file={certs.client_cert}",
                f"security.tls.client_key_file={certs.client_key}"]
    return out


@pytest.fixture
def tokens_env(monkeypatch: pytest.MonkeyPatch) -> Tokens:
    for role in ("rollout", "trainer", "operator"):
        monkeypatch.setenv(f"MESHRL_{role.upper()}_TOKEN", TOKENS.get(role) or "")  # type: ignore[arg-type]
    return TOKENS


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
def test_every_plain_server_and_client_speak_tls(tmp_path: Path, certs: Certs, tokens_env: Tokens, mtls: bool) -> None:
    cfg = load_config(None, [*OVERRIDES, *_tls_overrides(certs, mtls=mtls)])

    async def main() -> None:
        coord, ps, reward = CoordinatorServer(cfg, tmp_path / "c"), ParamServerServer(cfg, tmp_path / "p"), RewardServer(cfg)
        for s in (coord, ps, reward):
            await s.start()
        try:
            op, ro = client_security(cfg, OPERATOR), client_security(cfg, ROLLOUT)
            assert op.tls and (op.certificate_chain is not None) == mtls
            async with CoordinatorClient(coord.address, security=op) as c:
                assert (await c.status()).policy_version == 0
            async with ParamServerClient(ps.address, security=ro) as p:
                assert await p.list_versions() == []
            async with RewardClient(reward.address, security=ro, max_retries=0) as r:
                item = reward_pb2.ScoreItem(item_id="a", data_source="meshrl/addition", response_text="4", ground_truth="4")
                assert (await r.score(reward_pb2.ScoreRequest(items=[item]))).results[0].score == 1.0
            # Plaintext to a TLS port: no connection, whatever the token.
            async with CoordinatorClient(coord.address, security=ChannelSecurity(token=TOKENS.operator), timeout_s=3) as c:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.status()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            if mtls:
                no_cert = ChannelSecurity(token=TOKENS.operator).with_tls(tls=True, ca_file=str(certs.ca),
                                                                            server_name="localhost")
                stranger = no_cert.with_tls(tls=True, cert_file=str(certs.stranger_cert), key_file=str(certs.stranger_key))
                for sec in (no_cert, stranger):
                    async with CoordinatorClient(coord.address, security=sec, timeout_s=3) as c:
                        with pytest.raises(grpc.aio.AioRpcError) as e:
                            await c.status()
                        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                    async with ParamServerClient(ps.address, security=sec, timeout_s=3) as p:
                        with pytest.raises(TLS_ERRORS):
                            await p.list_versions()
        finally:
            for s in (reward, ps, coord):
                await s.stop()

    asyncio.run(main())


def test_older_coordinator_tls_keys_still_work(tmp_path: Path, certs: Certs) -> None:
    cfg = load_config(None, [*OVERRIDES, "coordinator.host=localhost", f"coordinator.tls_cert_file={certs.server_cert}",
                             f"coordinator.tls_key_file={certs.server_key}", "coordinator.token=t0k"])

    async def main() -> None:
        server = CoordinatorServer(cfg, tmp_path)
        await server.start()
        try:
            async with CoordinatorClient(server.address, ca_file=str(certs.ca), token="t0k") as c:
                await c.pause()
                assert (await c.status()).paused
        finally:
            await server.stop()

    asyncio.run(main())


# ---- keepalive --------------------------------------------------------------------------------------


def _watch_server(tmp_path: Path, server_limits: list[str] | None) -> Any:
    """A coordinator whose server keepalive policy is meshrl's (limits overrides) or, with None,
    gRPC's default policy (what Ray Serve's proxy runs: pings without data at most every 5 min).
    Build it inside the event loop that serves it."""
    cfg = load_config(None, [*OVERRIDES, *(server_limits or [])])
    server = CoordinatorServer(cfg, tmp_path)
    if server_limits is None:
        server.server = grpc.aio.server()  # default options, no meshrl interceptor: the proxy's policy
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(server.servicer, server.server)
        server.port = bind_port(server.server, "127.0.0.1:0", "test")
    return server


async def _idle_watch(tmp_path: Path, server_limits: list[str] | None, keepalive: Keepalive, idle_s: float) -> str:
    """Open WatchVersions, stay idle IDLE_S, then pause the run and expect the update on the same
    stream. Returns "survived" or the error that ended the stream."""
    server = _watch_server(tmp_path, server_limits)
    await server.start()
    try:
        channel = create_channel(server.address, keepalive=keepalive)
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        call = stub.WatchVersions(coordinator_pb2.WatchVersionsRequest(replica_id="r"))
        try:
            first = await call.read()
            assert not first.paused
            await asyncio.sleep(idle_s)
            server.servicer.core.set_paused(True)
            server.servicer._notify()
            second = await asyncio.wait_for(call.read(), 10)
            assert second.paused
            return "survived"
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        finally:
            call.cancel()
            await channel.close()
    finally:
        await server.stop()


def test_an_idle_watch_survives_meshrl_servers(tmp_path: Path) -> None:
    """meshrl's defaults (clients ping every 30 s, servers accept pings every 10 s) over a
    10-minute idle WatchVersions, scaled down 60x: clients every 0.5 s, servers accept every
    0.16 s, 10 s idle (20 pings with no data, where gRPC's default policy allows 2)."""
    limits = ["security.limits.keepalive_time_s=0.5", "security.limits.keepalive_min_time_s=0.16"]
    ka = Keepalive(time_s=0.5, timeout_s=5, min_time_s=0.16)
    assert asyncio.run(_idle_watch(tmp_path, limits, ka, idle_s=10)) == "survived"


def test_the_same_pings_against_grpc_default_policy_are_refused(tmp_path: Path) -> None:
    """Control: the earlier meshrl server (gRPC's default policy) sends the same client GOAWAY
    too_many_pings, as it did after ~150 s at 30 s pings; so the test above can fail."""
    outcome = asyncio.run(_idle_watch(tmp_path, None, Keepalive(time_s=0.5, timeout_s=5, min_time_s=0.16), idle_s=10))
    assert outcome.startswith("UNAVAILABLE") and "ping" in outcome.lower(), outcome


def test_channels_to_serve_ingress_ping_within_its_policy() -> None:
    opts = dict(message_options(ingress=True))
    assert opts["grpc.keepalive_time_ms"] > 300_000  # the proxy allows one ping per 5 min without data
    assert opts["grpc.keepalive_permit_without_calls"] == 0  # and none without a call
    plain = dict(message_options())
    assert plain["grpc.keepalive_time_ms"] == 30_000


def test_keepalive_config_refuses_settings_that_would_goaway_meshrl_clients() -> None:
    from services.common.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="too_many_pings"):
        load_config(None, ["security.limits.keepalive_time_s=5", "security.limits.keepalive_min_time_s=10"])


# ---- reflection, warnings, logs ----------------------------------------------------------------------


def test_reflection_v1_and_v1alpha(tmp_path: Path) -> None:
    from grpc_reflection.v1alpha import reflection_pb2

    cfg = load_config(None, OVERRIDES)

    async def main() -> None:
        server = CoordinatorServer(cfg, tmp_path)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as ch:
                for version in ("v1", "v1alpha"):
                    call = ch.stream_stream(
                        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                    )(iter([
                        reflection_pb2.ServerReflectionRequest(list_services=""),
                        reflection_pb2.ServerReflectionRequest(file_containing_symbol="meshrl.v1.CoordinatorService"),
                    ]), timeout=10)
                    listed, files = [r async for r in call]
                    names = {s.name for s in listed.list_services_response.service}
                    assert {"meshrl.v1.CoordinatorService", "grpc.reflection.v1.ServerReflection",
                            "grpc.reflection.v1alpha.ServerReflection"} <= names, version
                    assert files.file_descriptor_response.file_descriptor_proto, version
        finally:
            await server.stop()

    asyncio.run(main())


@pytest.mark.parametrize(("host", "tokens", "warns"), [("0.0.0.0", False, True), ("0.0.0.0", True, True),
                                                         ("127.0.0.1", False, False)])
def test_a_server_reachable_from_other_hosts_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: str,
                                                        tokens: bool, warns: bool) -> None:
    from services.common import security

    monkeypatch.setattr(security, "_warned", set())
    if tokens:
        monkeypatch.setenv("MESHRL_OPERATOR_TOKEN", "x")
    cfg = load_config(None, [*OVERRIDES, f"coordinator.host={host}"])
    async def build_twice() -> None:
        for _ in range(2):
            server = CoordinatorServer(cfg, tmp_path)
            await server.server.stop(0)
            server.servicer.core.ledger.close()

    with capture_logs() as logs:
        asyncio.run(build_twice())
    exposed = [e for e in logs if e["event"] == "server_exposed"]
    assert len(exposed) == int(warns), exposed
    if warns:
        e = exposed[0]
        assert e["missing"] == (["TLS"] if tokens else ["tokens", "TLS"])
        assert "security.tls.cert_file" in e["fix"] and ("MESHRL_ROLLOUT_TOKEN" in e["fix"]) != tokens


class _Echoing(coordinator_pb2_grpc.CoordinatorServiceServicer):
    @rpc_method()
    async def Echo(self, request: coordinator_pb2.EchoRequest, context: Any) -> coordinator_pb2.EchoResponse:
        payload = request.payload  # a local holding the whole request
        raise RuntimeError(f"unexpected: {len(payload)} bytes")


async def _echo_server() -> tuple[Any, str]:
    server = create_server(auth=Authorizer())
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(_Echoing(), server)
    add_health_and_reflection(server, [])
    port = bind_port(server, "127.0.0.1:0", "test")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_internal_errors_log_no_request_and_undecodable_requests_log_once() -> None:
    secret = b"SECRET-PAYLOAD-" * 20_000  # 300 KB

    async def main() -> tuple[list[grpc.StatusCode], grpc.StatusCode, str]:
        server, address = await _echo_server()
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                echo = ch.unary_unary("/meshrl.v1.CoordinatorService/Echo")
                codes = []
                for _ in range(50):
                    try:
                        await echo(b"\xff\xff\xff\xff", timeout=5)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
                try:
                    await echo(coordinator_pb2.EchoRequest(payload=secret).SerializeToString(), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    return codes, exc.code(), exc.details() or ""
            raise AssertionError("Echo did not fail")
        finally:
            await server.stop(0)

    buf = io.StringIO()
    from services.common.logging import configure_logging

    configure_logging("test", json=True, stream=buf)
    try:
        with capture_logs() as logs:
            codes, code, details = asyncio.run(main())
    finally:
        configure_logging("test", json=False)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 50
    assert [e["event"] for e in logs].count("request_undecodable") == 1  # one line for 50 calls
    assert code == grpc.StatusCode.INTERNAL and "RuntimeError" in details
    internal = [e for e in logs if e["event"] == "rpc_internal_error"]
    assert len(internal) == 1 and "SECRET-PAYLOAD" not in json.dumps(internal[0], default=str)
    assert len(json.dumps(internal[0], default=str)) < 20_000


def test_rendered_tracebacks_carry_no_locals() -> None:
    from services.common.logging import configure_logging, get_logger

    buf = io.StringIO()
    configure_logging("test", json=True, stream=buf)
    try:
        def handler(request: bytes) -> None:
            raise ValueError("boom")

        try:
            handler(b"SECRET-" * 100_000)
        except ValueError as exc:
            get_logger("t").error("failed", exc_info=exc)
    finally:
        configure_logging("test", json=False)
    text = buf.getvalue()
    assert "boom" in text and "SECRET-" not in text and len(text) < 10_000

