"""The trainer deployment on real Ray Serve, against a real coordinator (plain grpc.aio server)
fed with hand-made trajectory groups through the real gRPC client: two CPU rank actors (gloo)
train a tiny Qwen3, publish a version per step, checkpoint, stop at the end of the run; a
redeployed trainer resumes from the newest checkpoint and republishes. TrainerService is called
through Serve's gRPC ingress."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.config import MeshConfig, load_config
from services.common.tiny import build_tokenizer
from services.coordinator.client import CoordinatorClient
from services.coordinator.server import CoordinatorServer

TOKEN = "t0k3n"



def _config(run_dir: Path, total_training_steps: int, port: int = 0, coordinator: str | None = None) -> MeshConfig:
    overrides = [
        f"coordinator.port={port}", f"coordinator.token={TOKEN}",
        "data.synthetic.num_train=32", "data.max_response_length=8", "data.max_prompt_length=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=0.5",
        "rollout.total_rollout_steps=16", f"trainer.total_training_steps={total_training_steps}",
        "trainer.device=cpu", "trainer.n_gpus_per_node=2", "trainer.save_freq=-1",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        "trainer_service.fetch_timeout_ms=500", "trainer_service.worker_num_cpus=1",
        "serve.trainer.num_cpus=0.5",
    ]
    if coordinator:
        overrides.append(f"trainer_service.coordinator_address={coordinator}")
    return load_config(None, overrides)


class CoordinatorThread:
    """A plain grpc.aio coordinator plus a fake rollout feeding it, on their own event loop."""

    def __init__(self, cfg: MeshConfig, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.address = ""
        self.submitted = 0
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        server = CoordinatorServer(self.cfg, self.run_dir)
        await server.start()
        self.address = server.address
        self.ready.set()
        tok = build_tokenizer()
        rng = random.Random(0)
        async with CoordinatorClient(self.address, token=TOKEN) as client:
            while not self.stop.is_set():
                grant = await client.lease("fake-rollout", 4)
                groups = []
                for lease in grant.leases:
                    prompt = tok(lease.prompt.text or lease.prompt.messages[0].content)["input_ids"]
                    g = common_pb2.TrajectoryGroup(
                        lease_id=lease.lease_id, prompt=lease.prompt, prompt_token_ids=prompt,
                        min_policy_version=lease.policy_version, max_policy_version=lease.policy_version,
                    )
                    for i in range(grant.sampling.n):
                        n = rng.randint(2, 8)
                        g.responses.add(
                            sample_index=i, token_ids=[rng.randint(10, 60) for _ in range(n)],
                            logprobs=[-rng.uniform(1.0, 4.0) for _ in range(n)], versions=[lease.policy_version] * n,
                            reward=float(i % 2), reward_metrics={"acc": float(i % 2)},
                        )
                    groups.append(g)
                if groups:
                    await client.submit("fake-rollout", groups)
                    self.submitted += len(groups)
                else:
                    await asyncio.sleep(0.2)
        await server.stop()

    def __enter__(self) -> CoordinatorThread:
        self.thread.start()
        assert self.ready.wait(60), "coordinator did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    def status(self) -> Any:
        async def get() -> Any:
            async with CoordinatorClient(self.address, token=TOKEN) as c:
                return await c.status()

        return asyncio.run_coroutine_threadsafe(get(), self.loop).result(30)


def _trainer_status(port: int) -> trainer_pb2.GetTrainerStatusResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = trainer_pb2_grpc.TrainerServiceStub(ch)
        return stub.GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=30,
                                     metadata=[("application", "trainer"), ("authorization", f"Bearer {TOKEN}")])


def _wait_finished(timeout_s: float) -> None:
    from ray import serve

    handle = serve.get_app_handle("trainer")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = handle.status.remote().result(timeout_s=30)
        assert st.state != "failed", st.error
        if st.state == "finished":
            return
        time.sleep(0.5)
    raise AssertionError(f"trainer did not finish within {timeout_s} s: {st}")


def test_trainer_trains_publishes_checkpoints_and_resumes(serve_grpc_port: int, tmp_path: Path) -> None:
    from ray import serve

    from services.trainer.deployment import build_app

    coord_cfg = _config(tmp_path, total_training_steps=99)
    with CoordinatorThread(coord_cfg, tmp_path / "coordinator") as coord:
        cfg = _config(tmp_path, total_training_steps=2, coordinator=coord.address)
        serve.run(build_app({"config": cfg.model_dump(mode="json"), "run_dir": str(tmp_path)}), name="trainer", route_prefix="/trainer")
        _wait_finished(300)
        status = _trainer_status(serve_grpc_port)
        assert (status.step, status.policy_version, status.world_size, status.engine) == (2, 2, 2, "fsdp2")
        assert status.last_checkpoint_step == 2 and status.metrics["actor/lr"] == pytest.approx(1e-3)
        c = coord.status()
        assert c.policy_version == 2 and c.last_checkpoint_step == 2 and c.totals.consumed == 4
        with grpc.insecure_channel(f"127.0.0.1:{serve_grpc_port}") as ch:
            stub = trainer_pb2_grpc.TrainerServiceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), metadata=[("application", "trainer")], timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            resp = stub.SaveCheckpoint(
                trainer_pb2.SaveCheckpointRequest(),
                metadata=[("application", "trainer"), ("authorization", f"Bearer {TOKEN}")], timeout=60,
            )
            assert resp.step == 2 and Path(resp.path).name == "global_step_2"

        # a new trainer replica with a longer run resumes from global_step_2 and republishes
        serve.delete("trainer")
        cfg = _config(tmp_path, total_training_steps=4, coordinator=coord.address)
        serve.run(build_app({"config": cfg.model_dump(mode="json"), "run_dir": str(tmp_path)}), name="trainer", route_prefix="/trainer")
        _wait_finished(300)
        status = _trainer_status(serve_grpc_port)
        assert status.step == 4 and status.policy_version == 5  # v3 = restored weights, then v4, v5
        c = coord.status()
        assert c.policy_version == 5 and c.last_checkpoint_step == 4 and c.totals.consumed == 8
        serve.delete("trainer")
    lines = [json.loads(x) for x in (tmp_path / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert all(x["training/groups"] == 2 and x["training/sequences"] == 8 for x in lines)
    assert all("actor/pg_loss" in x and "perf/throughput_tokens_per_s" in x for x in lines)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["global_step_2", "global_step_4"]


def test_ray_group_exports_the_weights_at_the_call_while_training_goes_on(serve_grpc_port: int) -> None:
    """The overlapped trainer loop trains step s+1 while version s is still being read: an
    export asked for before a train call must hold the weights from before that step."""
    import torch

    from services.trainer.workers import RayTrainGroup
    from services.weights.layout import fingerprint_bytes
    from services.weights.packing import PackedBucket
    from tests.unit.fsdp_helpers import fixed_batch, make_spec, nll_loss

    async def weights(stream: Any) -> dict[str, torch.Tensor]:
        buckets = [b async for b in stream]
        # each bucket crossed from the rank as its packed buffer (once) and arrives as views of it
        assert all(len({t.untyped_storage().data_ptr() for _, t in b}) == 1 for b in buckets)
        assert all(b[0][1].untyped_storage().nbytes() == sum(t.nbytes for _, t in b) for b in buckets)
        # with the fingerprint the rank took as it packed them: the publisher reads no byte for it
        assert all(isinstance(b, PackedBucket) and b.fingerprint == fingerprint_bytes(b.buffer.numpy()) for b in buckets)
        return {name: t for bucket in buckets for name, t in bucket}

    async def scenario() -> None:
        group = await RayTrainGroup.create(make_spec(optim={"lr": 1e-2}), 1, backend="fsdp", num_cpus=0.01)
        try:
            before = await weights(group.export_weights(1 << 30))
            pending = group.export_weights(1 << 10)  # many buckets, none read yet
            await group.train(fixed_batch(), nll_loss, temperature=1.0)
            exported = await weights(pending)
            after = await weights(group.export_weights(1 << 30))
        finally:
            await group.close()
        assert exported.keys() == before.keys()
        assert all(torch.equal(exported[k], before[k]) for k in before)
        assert not all(torch.equal(after[k], before[k]) for k in before)

    asyncio.run(asyncio.wait_for(scenario(), timeout=300))


class _SlowPidPublisher:
    """Built on rank 0: reads the buckets slowly (training goes on meanwhile) and answers with
    their digest and the pid of the process it ran in."""

    def __init__(self, per_bucket_s: float) -> None:
        self.per_bucket_s = per_bucket_s

    async def publish(self, version: int, buckets: Any) -> common_pb2.WeightsRef:
        import hashlib
        import os

        from services.weights import iterate_buckets
        from services.weights.in_process import tensor_digest

        h = hashlib.sha256()
        async for bucket in iterate_buckets(buckets):
            await asyncio.sleep(self.per_bucket_s)
            for name, tensor in bucket:
                tensor_digest(h, name, tensor)
        return common_pb2.WeightsRef(policy_version=version, manifest_checksum=h.hexdigest(),
                                     param_server_address=f"pid:{os.getpid()}")


def test_rank_zero_sender_publishes_the_weights_at_the_call_from_the_rank(serve_grpc_port: int) -> None:
    """The collective transports send from rank 0 (RankZeroPublisher): the publisher runs in the
    rank's process, and a publish asked for before a train call carries the weights from before
    that step while the step runs."""
    import functools
    import hashlib
    import os

    from services.trainer.workers import RayTrainGroup
    from services.weights.in_process import tensor_digest
    from tests.unit.fsdp_helpers import fixed_batch, make_spec, nll_loss

    async def digest(stream: Any) -> str:
        h = hashlib.sha256()
        async for bucket in stream:
            for name, tensor in bucket:
                tensor_digest(h, name, tensor)
        return h.hexdigest()

    async def scenario() -> None:
        group = await RayTrainGroup.create(make_spec(optim={"lr": 1e-2}), 1, backend="fsdp", num_cpus=0.01)
        try:
            await group.start_sender(functools.partial(_SlowPidPublisher, 0.01))
            before = await digest(group.export_weights(1 << 30))
            first = asyncio.ensure_future(group.publish_weights(1, 1 << 10))  # many buckets
            await group.train(fixed_batch(), nll_loss, temperature=1.0)
            ref1 = await first
            after = await digest(group.export_weights(1 << 30))
            ref2 = await group.publish_weights(2, 1 << 30)
        finally:
            await group.close()
        assert before != after
        assert (ref1.policy_version, ref1.manifest_checksum) == (1, before)
        assert (ref2.policy_version, ref2.manifest_checksum) == (2, after)
        assert ref1.param_server_address.startswith("pid:") and ref1.param_server_address != f"pid:{os.getpid()}"

    asyncio.run(asyncio.wait_for(scenario(), timeout=300))
