"""Every meshrl service as a plain grpc.aio server on loopback, in one background event loop, with
the real servicers behind them (a coordinator with its SQLite ledger, the param server's store,
the reward pipeline, a rollout worker on the tiny transformers model, a trainer loop on the tiny
FSDP engine), and a blocking caller that speaks any RPC by its descriptor.

    with PlainMesh(tmp_path, tokens=TOKENS) as mesh:
        code, reply = mesh.call("meshrl.v1.CoordinatorService", "GetStatus", b"", token=TOKENS.operator)
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message

from meshrl.v1 import (
    coordinator_pb2,
    environment_pb2,
    param_server_pb2,
    reward_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.common.auth import Authorizer, Tokens, default_env_names
from services.common.config import MeshConfig, load_config
from services.common.grpc_util import add_health_and_reflection, bind_port, create_server, set_serving

SERVICES: dict[str, ServiceDescriptor] = {
    d.services_by_name[n].full_name: d.services_by_name[n]
    for d, n in (
        (coordinator_pb2.DESCRIPTOR, "CoordinatorService"),
        (environment_pb2.DESCRIPTOR, "EnvironmentService"),
        (param_server_pb2.DESCRIPTOR, "ParamServerService"),
        (reward_pb2.DESCRIPTOR, "RewardService"),
        (rollout_pb2.DESCRIPTOR, "RolloutService"),
        (trainer_pb2.DESCRIPTOR, "TrainerService"),
    )
}
TOKENS = Tokens(rollout="rollout-secret", trainer="trainer-secret", operator="operator-secret")
OVERRIDES = [
    "coordinator.port=0", "param_server.port=0", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "rollout.total_rollout_steps=1000", "async_training.trigger_parameter_sync_step=1",
    "async_training.staleness_threshold=1.0", "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=32",
    "data.max_response_length=4", "coordinator.max_message_mb=2", "param_server.max_message_mb=2",
    "param_server.chunk_mb=1", "param_server.transfer_timeout_s=10", "param_server.stall_timeout_s=5",
    "reward.scorer_processes=false",
]


def all_methods() -> list[tuple[str, MethodDescriptor]]:
    return [(name, m) for name, svc in SERVICES.items() for m in svc.methods]


def message_class(desc: Any) -> type[Message]:
    return message_factory.GetMessageClass(desc)  # type: ignore[no-any-return]


def metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


class PlainMesh:
    """See the module docstring. TOKENS: what the servers accept (None: auth off)."""

    def __init__(self, root: Path, *, tokens: Tokens | None = TOKENS, overrides: Sequence[str] = (),
                 with_rollout: bool = True, with_trainer: bool = True) -> None:
        self.root = root
        self.tokens = tokens
        self.cfg: MeshConfig = load_config(None, [*OVERRIDES, *overrides])
        self.with_rollout = with_rollout
        self.with_trainer = with_trainer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="plain-mesh", daemon=True)
        self.addresses: dict[str, str] = {}
        self.parts: dict[str, Any] = {}
        self._channels: dict[str, grpc.Channel] = {}

    # ---- lifecycle ------------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def __enter__(self) -> PlainMesh:
        self.thread.start()
        names = default_env_names()
        saved = {k: os.environ.get(k) for k in [*names.values(), "MESHRL_TOKEN"]}
        try:
            for role, var in names.items():
                os.environ.pop(var, None)
                if self.tokens is not None and self.tokens.get(role):
                    os.environ[var] = self.tokens.get(role) or ""
            os.environ.pop("MESHRL_TOKEN", None)
            self.run(self._start(), timeout_s=300)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return self

    def __exit__(self, *exc: object) -> None:
        for ch in self._channels.values():
            ch.close()
        try:
            self.run(self._stop(), timeout_s=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)

    async def _start(self) -> None:
        from services.coordinator.server import CoordinatorServer
        from services.environment.factory import tool_environment
        from services.environment.server import EnvironmentServer
        from services.param_server.server import ParamServerServer
        from services.reward.server import RewardServer

        cfg = self.cfg
        coord = CoordinatorServer(cfg, self.root / "coordinator")
        await coord.start()
        ps = ParamServerServer(cfg, self.root / "param_server")
        await ps.start()
        reward = RewardServer(cfg)
        await reward.start()
        # `meshrl environment serve`'s server, on the mesh's role tokens
        environment = EnvironmentServer(tool_environment(cfg), cfg.environment, host="127.0.0.1", port=0)
        await environment.start()
        self.parts.update(coordinator=coord, param_server=ps, reward=reward, environment=environment)
        self.addresses.update({
            "meshrl.v1.CoordinatorService": coord.address, "meshrl.v1.ParamServerService": ps.address,
            "meshrl.v1.RewardService": reward.address, "meshrl.v1.EnvironmentService": environment.address,
        })
        if self.with_rollout:
            await self._start_rollout()
        if self.with_trainer:
            await self._start_trainer(coord.address)

    async def _plain(self, name: str, add: Callable[[Any, Any], None], servicer: Any) -> None:
        auth = Authorizer.from_config(self.cfg)
        servicer.auth = auth
        server = create_server(auth=auth, limits=self.cfg.security.limits)
        add(servicer, server)
        health = add_health_and_reflection(server, [name])
        port = bind_port(server, "127.0.0.1:0", "test")
        await server.start()
        await set_serving(health, [name])
        self.parts[name] = server
        self.addresses[name] = f"127.0.0.1:{port}"

    async def _start_rollout(self) -> None:
        from services.rollout import factory
        from services.rollout.servicer import RolloutServicer

        engine, tok = factory.build_engine(self.cfg)
        await engine.start()
        worker = factory.build_worker(self.cfg, engine, tok, coordinator=None, scorer=None, fetcher=None)
        self.parts["rollout_engine"] = engine
        servicer = RolloutServicer(worker, factory.validation_sampling(self.cfg), max_n=4)
        await self._plain("meshrl.v1.RolloutService", rollout_pb2_grpc.add_RolloutServiceServicer_to_server, servicer)

    async def _start_trainer(self, coordinator_address: str) -> None:
        from services.common.model_arch import vocab_size_of
        from services.common.security import ChannelSecurity
        from services.coordinator.client import CoordinatorClient
        from services.trainer import factory
        from services.trainer.core import TrainerLoop
        from services.trainer.engines.base import get_engine_cls
        from services.trainer.group import LocalTrainGroup
        from services.trainer.servicer import TrainerServicer
        from services.weights.in_process import InProcessPublisher

        cfg = self.cfg
        spec = factory.engine_spec(cfg, "cpu", 64)
        engine = await asyncio.to_thread(get_engine_cls("fsdp", "cpu").build, spec)
        group = LocalTrainGroup(engine, spec.actor)
        client = CoordinatorClient(coordinator_address, security=ChannelSecurity(token=self.tokens.trainer if self.tokens else None))
        vocab = vocab_size_of(cfg.actor_rollout_ref.model.path)
        settings = factory.loop_settings(cfg.trainer_service, self.root / "trainer", 64, 0, vocab)
        loop = TrainerLoop(settings, group, client, InProcessPublisher(), factory.algorithm_from_config(cfg))
        servicer = TrainerServicer(loop, trainer_id="t0", engine="fsdp", checkpoint_timeout_s=0.5)
        self.parts["trainer_client"] = client
        await self._plain("meshrl.v1.TrainerService", trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer)

    async def _stop(self) -> None:
        for name in ("meshrl.v1.RolloutService", "meshrl.v1.TrainerService"):
            if name in self.parts:
                await self.parts[name].stop(0.5)
        if "trainer_client" in self.parts:
            await self.parts["trainer_client"].close()
        if "rollout_engine" in self.parts:
            await self.parts["rollout_engine"].close()
        for key in ("environment", "reward", "param_server", "coordinator"):
            await self.parts[key].stop(0.5)

    # ---- calling --------------------------------------------------------------------------------

    def channel(self, service: str) -> grpc.Channel:
        ch = self._channels.get(service)
        if ch is None:
            ch = self._channels[service] = grpc.insecure_channel(
                self.addresses[service],
                options=[("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)],
            )
        return ch

    def call(
        self, service: str, method: str, request: Message | bytes | Sequence[Message | bytes] | None = None, *,
        token: str | None = None, timeout_s: float = 10.0, max_messages: int = 3,
    ) -> tuple[grpc.StatusCode, str, list[Any]]:
        """Call SERVICE/METHOD with REQUEST (a message, raw bytes, or for client streaming a list of
        them; None: the default message). Returns (code, details, replies); a server stream is read
        for up to MAX_MESSAGES messages, then cancelled."""
        m = SERVICES[service].methods_by_name[method]
        path = f"/{service}/{method}"
        out_cls = message_class(m.output_type)
        ch = self.channel(service)
        md = metadata(token)

        def ser(x: Any) -> bytes:
            return x if isinstance(x, bytes) else x.SerializeToString()

        if request is None:
            request = [] if m.client_streaming else message_class(m.input_type)()
        replies: list[Any] = []
        try:
            if m.client_streaming and not m.server_streaming:
                items = request if isinstance(request, list) else [request]
                fn = ch.stream_unary(path, request_serializer=ser, response_deserializer=out_cls.FromString)
                replies.append(fn(iter(items), metadata=md, timeout=timeout_s))
            elif m.server_streaming:
                fn = ch.unary_stream(path, request_serializer=ser, response_deserializer=out_cls.FromString)
                call = fn(request, metadata=md, timeout=timeout_s)
                try:
                    for item in call:
                        replies.append(item)
                        if len(replies) >= max_messages:
                            break
                finally:
                    call.cancel()
            else:
                fn = ch.unary_unary(path, request_serializer=ser, response_deserializer=out_cls.FromString)
                replies.append(fn(request, metadata=md, timeout=timeout_s))
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", replies  # type: ignore[attr-defined]
        return grpc.StatusCode.OK, "", replies

    def token_for(self, service: str, method: str) -> str | None:
        """A token of a role that may call it."""
        from services.common.auth import RPC_ROLES

        if self.tokens is None:
            return None
        role = sorted(RPC_ROLES[service][method])[0]
        return self.tokens.get(role)

    def seed(self, leases: int = 4, submit: int = 2) -> None:
        """Give the coordinator something to lose: LEASES prompts in flight, SUBMIT of them
        answered and queued for the trainer (through the RPCs, with the rollout token)."""
        from meshrl.v1 import common_pb2, coordinator_pb2

        svc, token = "meshrl.v1.CoordinatorService", self.tokens.rollout if self.tokens else None
        code, details, (grant,) = self.call(svc, "LeasePrompts", coordinator_pb2.LeasePromptsRequest(
            replica_id="seed", max_groups=leases), token=token)
        assert code == grpc.StatusCode.OK and len(grant.leases) == leases, (code, details)
        groups = []
        for lease in grant.leases[:submit]:
            g = common_pb2.TrajectoryGroup(lease_id=lease.lease_id, prompt=lease.prompt, prompt_token_ids=[5, 6])
            for i in range(self.cfg.actor_rollout_ref.rollout.n):
                g.responses.add(sample_index=i, token_ids=[7, 8], logprobs=[-0.5, -0.5], versions=[0, 0],
                                reward=float(i))
            groups.append(g)
        code, details, _ = self.call(svc, "SubmitGroups", coordinator_pb2.SubmitGroupsRequest(
            replica_id="seed", groups=groups), token=token)
        assert code == grpc.StatusCode.OK, details

    # ---- state ----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """What rejected input must leave unchanged: the coordinator's status totals and version, the
        param server's versions and holds."""
        coord = self.parts["coordinator"].servicer.core
        ps = self.parts["param_server"].servicer.store

        async def read() -> dict[str, Any]:
            st = coord.status(0.0)
            return {
                "totals": dict(st.totals.__dict__), "policy_version": st.policy_version, "paused": st.paused,
                "stopping": st.stopping, "staleness_threshold": st.staleness_threshold,
                "trainer_step": st.trainer_step, "last_checkpoint_step": st.last_checkpoint_step,
                "queued": st.queued, "in_flight": st.in_flight,
                "versions": [(v.policy_version, sorted(v.holds)) for v in ps.versions()],
            }

        return self.run(read())  # type: ignore[no-any-return]

    def alive(self) -> bool:
        """Every server answers a health check."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        for ch in (self.channel(s) for s in self.addresses):
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            if resp.status != health_pb2.HealthCheckResponse.SERVING:
                return False
        return True
