"""Rollout replicas against the real coordinator (CoordinatorServer: grpc.aio on loopback, SQLite
ledger) with the real transformers engine: a replica killed mid-lease loses nothing — its prompts
come back through lease expiry and another replica answers them, each exactly once. Also the
RolloutService gRPC face on a plain grpc.aio server."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.config import load_config
from services.common.grpc_util import create_channel, create_server
from services.coordinator.client import CoordinatorClient
from services.coordinator.server import CoordinatorServer
from services.rollout import factory
from services.rollout.servicer import RolloutServicer
from services.weights.in_process import InMemoryWeightStore, model_named_tensors
from tests.rollout_helpers import length_scorer, wait_for

PROMPTS = 6


def _cfg(tmp_path: Path, max_response_length: int = 24) -> Any:
    return load_config(None, [
        "coordinator.port=0",
        "coordinator.lease_timeout_s=1.5",
        f"rollout.total_rollout_steps={PROMPTS}",
        "data.synthetic.num_train=16",
        f"data.max_response_length={max_response_length}",
        "data.max_prompt_length=64",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.seed=3",
        "actor_rollout_ref.rollout.max_num_seqs=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "async_training.concurrent_samples_per_replica=3",
        "rollout_worker.device=cpu",
        "rollout_worker.idle_poll_s=0.05",
        "rollout_worker.lease_renew_interval_s=0.4",
    ])


def test_killed_replica_prompts_return_through_lease_expiry(tmp_path: Path) -> None:
    # Long responses: replica A cannot finish a group in the moment between leasing and dying.
    cfg = _cfg(tmp_path, max_response_length=200)

    async def scenario() -> tuple[Any, list[str]]:
        server = CoordinatorServer(cfg, tmp_path / "run")
        await server.start()
        client_a = CoordinatorClient(server.address)
        client_b = CoordinatorClient(server.address)
        engine_a, tok = factory.build_engine(cfg)
        # Replica A: leases, starts generating long samples, then dies without a word.
        worker_a = factory.build_worker(cfg, engine_a, tok, coordinator=client_a, scorer=length_scorer, fetcher=None,
                                        replica_id="replica-a")
        await engine_a.start()
        worker_a.start()
        await wait_for(lambda: worker_a.groups_in_flight == 3, what="replica A holding leases")
        leased_by_a = [g.lease.prompt.prompt_seq for g in worker_a._groups.values()]
        for t in worker_a._tasks:
            t.cancel()
        for g in list(worker_a._groups.values()):
            assert g.task is not None
            g.task.cancel()
        await engine_a.close()  # the crash: no drain, no ReturnLeases, no submit
        await client_a.close()
        # Replica B picks up everything, A's prompts after their leases expire.
        engine_b, _ = factory.build_engine(cfg, tokenizer=tok)
        worker_b = factory.build_worker(cfg, engine_b, tok, coordinator=client_b, scorer=length_scorer, fetcher=None,
                                        replica_id="replica-b")
        await engine_b.start()
        worker_b.start()
        await wait_for(lambda: worker_b.counters.groups_submitted == PROMPTS, timeout_s=120, what="all groups")
        status = await client_b.status()
        batch = await client_b.fetch_batch("trainer", 1, PROMPTS, timeout_ms=1000)
        await worker_b.stop()
        await engine_b.close()
        await client_b.close()
        await server.stop()
        return (status, batch), [str(s) for s in leased_by_a]

    (status, batch), leased_by_a = asyncio.run(scenario())
    assert len(leased_by_a) == 3
    assert status.totals.leases_expired >= 3
    assert status.totals.queued == PROMPTS
    seqs = sorted(g.prompt.prompt_seq for g in batch.groups)
    assert seqs == sorted(set(seqs)) and len(seqs) == PROMPTS, "every prompt exactly once"
    assert {str(g.prompt.prompt_seq) for g in batch.groups if g.replica_id == "replica-b"} >= set(leased_by_a)
    for g in batch.groups:
        assert len(g.responses) == 2
        assert all(len(r.token_ids) == len(r.logprobs) == len(r.versions) > 0 for r in g.responses)


def test_rollout_service_over_grpc(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    cfg.rollout_worker.autostart = False

    async def scenario() -> None:
        engine, tok = factory.build_engine(cfg)
        store = InMemoryWeightStore()
        from services.common.tiny import build_tiny_model

        ref = store.publish(1, model_named_tensors(build_tiny_model("qwen3", tok, seed=5)))
        worker = factory.build_worker(cfg, engine, tok, coordinator=None, scorer=length_scorer, fetcher=store,
                                      replica_id="replica-v")
        await engine.start()
        server = create_server()
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(worker, factory.validation_sampling(cfg)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = create_channel(f"127.0.0.1:{port}")
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        try:
            prompt = common_pb2.Prompt(prompt_id="val:0", text="12+30=", ground_truth="42")
            resp = await stub.Generate(rollout_pb2.GenerateRequest(request_id="v0", prompt=prompt, score=True), timeout=60)
            assert resp.policy_version == 0
            assert len(resp.group.responses) == cfg.actor_rollout_ref.rollout.val_kwargs.n
            r = resp.group.responses[0]
            assert 0 < len(r.token_ids) <= cfg.data.max_response_length
            assert list(resp.group.prompt_token_ids) == tok.encode("12+30=")
            upd = await stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(weights=ref), timeout=60)
            assert upd.policy_version == 1
            st = await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10)
            assert st.policy_version == 1 and st.engine == "transformers" and st.replica_id == "replica-v"
            assert st.engine_stats["tokens_generated"] > 0
            bad = common_pb2.SamplingParams(n=1, max_tokens=4, top_p=1.5)
            try:
                await stub.Generate(rollout_pb2.GenerateRequest(prompt=prompt, sampling=bad), timeout=30)
                raise AssertionError("top_p=1.5 must be rejected")
            except Exception as exc:
                import grpc

                assert isinstance(exc, grpc.aio.AioRpcError)
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.top_p" in (exc.details() or "")
            drained = await stub.Drain(rollout_pb2.DrainRequest(finish_in_flight=True), timeout=30)
            assert drained.returned_leases == 0
        finally:
            await channel.close()
            await server.stop(1)
            with contextlib.suppress(Exception):
                await engine.close()

    asyncio.run(scenario())
