"""Every RPC of every service, fed fuzzed valid messages, random bytes and oversized input by a
caller holding the right token: never INTERNAL or UNKNOWN, the servers stay up, and input that is
refused leaves the state (coordinator status totals, the param server's versions and holds) as it
was. Examples are derandomized: the same inputs on every run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshrl.v1 import coordinator_pb2, reward_pb2
from services.common.auth import RPC_ROLES

from .mesh import SERVICES, PlainMesh, all_methods, message_class
from .strategies import messages

BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
# Answers that mean "refused": the state must be as before.
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.DATA_LOSS}
# RPCs that wait (for groups, a sender, a checkpoint, the next version): short deadlines.
WAITING = {"FetchBatch", "Rendezvous", "SaveCheckpoint", "WatchVersions"}
EXAMPLES = 40
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

COORDINATOR = "meshrl.v1.CoordinatorService"
SERVE_SIDE = [(s, m.name) for s, m in all_methods() if s in ("meshrl.v1.RolloutService", "meshrl.v1.TrainerService")]
CORE_SIDE = [(s, m.name) for s, m in all_methods() if (s, m.name) not in SERVE_SIDE]


def _ids(cases: list[tuple[str, str]]) -> list[str]:
    return [f"{s.rsplit('.', 1)[-1]}.{m}" for s, m in cases]


@pytest.fixture(scope="module")
def full_mesh(mesh_dir: Path) -> Iterator[PlainMesh]:
    with PlainMesh(mesh_dir / "full") as m:
        yield m


@pytest.fixture
def own_mesh(tmp_path: Path) -> Iterator[PlainMesh]:
    """A fresh coordinator, param server and reward service per RPC: what one RPC's fuzzing does
    to the state cannot make another RPC's test fail."""
    with PlainMesh(tmp_path, with_rollout=False, with_trainer=False) as m:
        m.seed()
        yield m


def _call(mesh: PlainMesh, service: str, method: str, request: object) -> tuple[grpc.StatusCode, str]:
    timeout = 1.0 if method in WAITING else 15.0
    code, details, _ = mesh.call(service, method, request, token=mesh.token_for(service, method),  # type: ignore[arg-type]
                                 timeout_s=timeout)
    return code, details


def _check(mesh: PlainMesh, service: str, method: str, request: object) -> None:
    before = mesh.snapshot()
    code, details = _call(mesh, service, method, request)
    assert code not in BAD, f"{service}/{method}: {code.name}: {details[:500]}"
    if code in REFUSED:
        assert mesh.snapshot() == before, f"{service}/{method} refused ({code.name}: {details[:200]}) but changed state"


def _requests(service: str, method: str) -> st.SearchStrategy[object]:
    m = SERVICES[service].methods_by_name[method]
    one = messages(m.input_type)
    return st.lists(one, max_size=4) if m.client_streaming else one


def _fuzz_messages(mesh: PlainMesh, service: str, method: str) -> None:
    @FUZZ
    @given(request=_requests(service, method))
    def run(request: object) -> None:
        _check(mesh, service, method, request)

    run()
    assert mesh.alive()


def _fuzz_bytes(mesh: PlainMesh, service: str, method: str) -> None:
    streaming = SERVICES[service].methods_by_name[method].client_streaming

    @FUZZ
    @given(raw=st.binary(min_size=1, max_size=256))
    def run(raw: bytes) -> None:
        _check(mesh, service, method, [raw] if streaming else raw)

    run()
    assert mesh.alive()


@pytest.mark.parametrize(("service", "method"), [pytest.param(s, m, id=i) for (s, m), i in zip(CORE_SIDE, _ids(CORE_SIDE), strict=True)])
def test_fuzzed_messages(own_mesh: PlainMesh, service: str, method: str) -> None:
    _fuzz_messages(own_mesh, service, method)


@pytest.mark.parametrize(("service", "method"), SERVE_SIDE, ids=_ids(SERVE_SIDE))
def test_fuzzed_messages_rollout_and_trainer(full_mesh: PlainMesh, service: str, method: str) -> None:
    _fuzz_messages(full_mesh, service, method)


ALL = [(s, m.name) for s, m in all_methods()]


@pytest.mark.parametrize(("service", "method"), ALL, ids=_ids(ALL))
def test_random_bytes(full_mesh: PlainMesh, service: str, method: str) -> None:
    _fuzz_bytes(full_mesh, service, method)


@pytest.mark.parametrize(("service", "method"), ALL, ids=_ids(ALL))
def test_over_the_message_limit(full_mesh: PlainMesh, service: str, method: str) -> None:
    """A request bigger than the server's message limit is RESOURCE_EXHAUSTED, whoever sends it."""
    m = SERVICES[service].methods_by_name[method]
    limit = {COORDINATOR: 2, "meshrl.v1.ParamServerService": 2}.get(service, 64) << 20
    raw = b"\x0a" + _varint(limit + 1024) + b"x" * (limit + 1024)  # field 1, length-delimited
    before = full_mesh.snapshot()
    code, details, _ = full_mesh.call(service, method, [raw] if m.client_streaming else raw,
                                      token=full_mesh.token_for(service, method), timeout_s=60)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert full_mesh.snapshot() == before and full_mesh.alive()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_every_rpc_is_fuzzed() -> None:
    assert {f"{s}/{m}" for s, m in CORE_SIDE + SERVE_SIDE} == {f"{s}/{m}" for s, ms in RPC_ROLES.items()
                                                               for m in ms if s in SERVICES}


# ---- long strings name their field ---------------------------------------------------------------


def test_long_ids_and_addresses_are_refused_by_name(full_mesh: PlainMesh) -> None:
    tok = full_mesh.tokens
    assert tok is not None
    cases = [
        ("RenewLeases", coordinator_pb2.RenewLeasesRequest(replica_id="r" * 300, lease_ids=["x"]), tok.rollout, "replica_id"),
        ("ReturnLeases", coordinator_pb2.ReturnLeasesRequest(replica_id="r", lease_ids=["l" * 300]), tok.rollout,
         "lease_ids[0]"),
        ("ReportCheckpoint", coordinator_pb2.ReportCheckpointRequest(trainer_id="t", step=1, path="/" * 5000),
         tok.trainer, "path"),
    ]
    commit = coordinator_pb2.CommitVersionRequest(trainer_id="t")
    commit.weights.policy_version = 1
    commit.weights.param_server_address = "h" * 100_000
    cases.append(("CommitVersion", commit, tok.trainer, "weights.param_server_address"))
    for method, req, token, field in cases:
        before = full_mesh.snapshot()
        code, details, _ = full_mesh.call(COORDINATOR, method, req, token=token)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":"), (method, code, details)
        assert "security.limits." in details
        assert full_mesh.snapshot() == before


def test_deep_json_in_reward_extra_info(full_mesh: PlainMesh) -> None:
    item = reward_pb2.ScoreItem(item_id="a", data_source="meshrl/addition", response_text="3", ground_truth="3",
                                extra_info_json="[" * 100_000 + "]" * 100_000)
    code, details, _ = full_mesh.call("meshrl.v1.RewardService", "Score", reward_pb2.ScoreRequest(items=[item]),
                                      token=full_mesh.tokens.rollout if full_mesh.tokens else None)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("items[0].extra_info_json:"), details
    assert "64 levels" in details


def test_message_class_helper_covers_every_input() -> None:
    for _, m in all_methods():
        assert message_class(m.input_type)().ByteSize() == 0
