"""The role x RPC matrix, over real gRPC to every service's plain server: for every RPC of every
service and every caller (no token, a wrong one, each role's), the answer the role table says —
and the check comes before the request is looked at."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from meshrl.v1 import coordinator_pb2, param_server_pb2
from services.common.auth import ROLES, RPC_ROLES

from .mesh import SERVICES, TOKENS, PlainMesh, all_methods

ROOT = Path(__file__).resolve().parents[2]
DENIED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
CALLERS = ["none", "wrong", *ROLES]


@pytest.fixture(scope="module")
def mesh(mesh_dir: Path) -> Iterator[PlainMesh]:
    with PlainMesh(mesh_dir) as m:
        yield m


def _token(caller: str) -> str | None:
    if caller == "none":
        return None
    if caller == "wrong":
        return "not-a-token"
    return TOKENS.get(caller)  # type: ignore[arg-type]


def test_every_rpc_of_every_service_is_in_the_role_table() -> None:
    for name, svc in SERVICES.items():
        assert set(RPC_ROLES[name]) == {m.name for m in svc.methods}, name
    # A service whose proto lands later (EnvironmentService) is checked the same way.
    import importlib

    try:
        env = importlib.import_module("meshrl.v1.environment_pb2").DESCRIPTOR.services_by_name["EnvironmentService"]
    except (ImportError, KeyError):
        return
    assert set(RPC_ROLES[env.full_name]) == {m.name for m in env.methods}


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize(("service", "method"), [(s, m.name) for s, m in all_methods()],
                         ids=[f"{s.rsplit('.', 1)[-1]}.{m.name}" for s, m in all_methods()])
def test_role_matrix(mesh: PlainMesh, service: str, method: str, caller: str) -> None:
    code, details, _ = mesh.call(service, method, token=_token(caller), timeout_s=15)
    allowed = RPC_ROLES[service][method]
    if caller in ("none", "wrong"):
        assert code == grpc.StatusCode.UNAUTHENTICATED, (code, details)
        assert "authorization: Bearer <token>" in details  # what a client in any language must send
    elif caller in allowed:
        assert code not in DENIED, (code, details)
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (code, details)
    else:
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        assert " or ".join(sorted(allowed)) in details and caller in details


def test_auth_comes_before_validation(mesh: PlainMesh) -> None:
    bad = coordinator_pb2.LeasePromptsRequest(replica_id="", max_groups=0)  # invalid twice over
    svc = "meshrl.v1.CoordinatorService"
    assert mesh.call(svc, "LeasePrompts", bad)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert mesh.call(svc, "LeasePrompts", bad, token=TOKENS.trainer)[0] == grpc.StatusCode.PERMISSION_DENIED
    assert mesh.call(svc, "LeasePrompts", bad, token=TOKENS.rollout)[0] == grpc.StatusCode.INVALID_ARGUMENT
    # Undecodable bytes from a stranger: refused for the token, never parsed.
    assert mesh.call(svc, "SubmitGroups", b"\xff\xff\xff")[0] == grpc.StatusCode.UNAUTHENTICATED
    assert mesh.call(svc, "SubmitGroups", b"\xff\xff\xff", token=TOKENS.rollout)[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_only_the_trainer_checks_in_as_the_rendezvous_sender(mesh: PlainMesh) -> None:
    svc = "meshrl.v1.ParamServerService"
    sender = param_server_pb2.RendezvousRequest(group="g", role="sender", member_id="m", world_size=0, backend="gloo")
    code, details, _ = mesh.call(svc, "Rendezvous", sender, token=TOKENS.rollout)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "sender" in details
    code, details, _ = mesh.call(svc, "Rendezvous", sender, token=TOKENS.trainer)
    assert code not in DENIED, details
    probe = param_server_pb2.RendezvousRequest(group="g", role="probe", policy_version=1)
    code, details, _ = mesh.call(svc, "Rendezvous", probe, token=TOKENS.rollout)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "probe" in details
    code, details, _ = mesh.call(svc, "Rendezvous", probe, token=TOKENS.trainer)
    assert code == grpc.StatusCode.OK, details


def test_bearer_scheme_and_case(mesh: PlainMesh) -> None:
    svc, method = "meshrl.v1.CoordinatorService", "GetStatus"
    ch = mesh.channel(svc)
    fn = ch.unary_unary(f"/{svc}/{method}", request_serializer=lambda m: m.SerializeToString(),
                        response_deserializer=coordinator_pb2.GetStatusResponse.FromString)
    req = coordinator_pb2.GetStatusRequest()
    fn(req, metadata=[("authorization", f"bearer {TOKENS.operator}")], timeout=10)  # scheme is case-insensitive
    for bad in (f"Basic {TOKENS.operator}", TOKENS.operator, "Bearer "):
        with pytest.raises(grpc.RpcError) as e:
            fn(req, metadata=[("authorization", bad)], timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_stay_open(mesh: PlainMesh) -> None:
    assert mesh.alive()  # grpc.health.v1 without a token


def test_auth_off_without_tokens(tmp_path: Path) -> None:
    with PlainMesh(tmp_path, tokens=None, with_rollout=False, with_trainer=False) as m:
        code, _, _ = m.call("meshrl.v1.CoordinatorService", "GetStatus")
        assert code == grpc.StatusCode.OK


def test_legacy_single_token_protects_every_role(tmp_path: Path) -> None:
    """coordinator.token (or MESHRL_TOKEN) alone: the operator token, which every role shares."""
    with PlainMesh(tmp_path, tokens=None, overrides=["coordinator.token=legacy"], with_rollout=False,
                   with_trainer=False) as m:
        svc = "meshrl.v1.CoordinatorService"
        assert m.call(svc, "GetStatus")[0] == grpc.StatusCode.UNAUTHENTICATED
        assert m.call(svc, "GetStatus", token="legacy")[0] == grpc.StatusCode.OK
        assert m.call(svc, "LeasePrompts", coordinator_pb2.LeasePromptsRequest(replica_id="r", max_groups=1),
                      token="legacy")[0] == grpc.StatusCode.OK


def test_proto_comments_state_every_rpc_auth_rule() -> None:
    for name, svc in SERVICES.items():
        text = (ROOT / "protos" / "meshrl" / "v1" / f"{svc.file.name.rsplit('/', 1)[-1]}").read_text()
        assert "authorization: Bearer <token>" in text, name
        for m in svc.methods:
            block = re.search(rf"((?://[^\n]*\n\s*)+)rpc {m.name}\(", text)
            assert block is not None, f"{name}.{m.name} has no comment"
            said = re.search(r"// Auth: ([^\n]*)", block.group(1))
            assert said is not None, f"{name}.{m.name}: no `Auth:` line"
            roles = RPC_ROLES[name][m.name]
            want = "any role" if len(roles) == len(ROLES) else " or ".join(sorted(roles))
            assert said.group(1).startswith(want), (name, m.name, said.group(1))
