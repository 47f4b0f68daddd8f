"""RolloutWorker with the real transformers engine, a hand-written fake coordinator and a simple
real scorer: the loop, partial rollout across a weight update (keep / abort / off), lost leases,
drain."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from meshrl.v1 import common_pb2
from services.common.tiny import build_tiny_model, build_tokenizer
from services.rollout.engines import Finish
from services.rollout.engines.transformers_engine import TransformersEngine
from services.rollout.weights import InMemoryWeightStore, model_named_tensors
from services.rollout.worker import RolloutWorker, WorkerSettings
from tests.rollout_helpers import FakeCoordinator, length_scorer, reference_logprobs, wait_for


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer()


def _prompts(n: int) -> list[common_pb2.Prompt]:
    out = []
    for i in range(n):
        p = common_pb2.Prompt(prompt_seq=i, prompt_id=f"train:{i}", ground_truth=str(i), data_source="test")
        p.messages.add(role="user", content=f"what is {i}+{i}?")
        out.append(p)
    return out


def _worker(tok: Any, coord: FakeCoordinator, store: InMemoryWeightStore, **kw: Any) -> tuple[RolloutWorker, TransformersEngine]:
    model = build_tiny_model("qwen3", tok, seed=0)
    engine = TransformersEngine(model, tok, max_num_seqs=kw.pop("max_num_seqs", 16))
    settings = WorkerSettings(replica_id="r0", idle_poll_s=0.05, renew_interval_s=kw.pop("renew_interval_s", 0.2), **kw)
    return RolloutWorker(engine, tok, coord, length_scorer, store, settings), engine


def test_loop_leases_generates_scores_and_submits(tok: Any) -> None:
    sampling = common_pb2.SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5)
    coord = FakeCoordinator(_prompts(6), sampling)

    async def scenario() -> None:
        worker, engine = _worker(tok, coord, InMemoryWeightStore(), concurrent_groups=2)
        await engine.start()
        worker.start()
        await wait_for(lambda: len(coord.submitted) == 6, what="6 submitted groups")
        await worker.stop()
        await engine.close()

    asyncio.run(scenario())
    seqs = sorted(g.prompt.prompt_seq for g in coord.submitted)
    assert seqs == list(range(6))
    for g in coord.submitted:
        assert len(g.responses) == 3
        text = tok.apply_chat_template(
            [{"role": "user", "content": g.prompt.messages[0].content}], add_generation_prompt=True, tokenize=False
        )
        assert list(g.prompt_token_ids) == tok.encode(text)
        for r in g.responses:
            assert len(r.token_ids) == len(r.logprobs) == len(r.versions) <= 12
            assert r.text == tok.decode(list(r.token_ids), skip_special_tokens=True)
            assert r.reward == pytest.approx(sum(c.isdigit() for c in r.text) / max(1, len(r.text)))
            assert r.reward_metrics["len"] == len(r.text)
        assert g.min_policy_version == g.max_policy_version == 0
    # seeds differ per prompt: two groups never share their samples
    assert len({tuple(g.responses[0].token_ids) for g in coord.submitted}) == 6


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_partial_rollout_spans_a_weight_update(tok: Any, mode: str) -> None:
    max_tokens = 120
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=max_tokens, seed=1)
    coord = FakeCoordinator(_prompts(1), sampling)
    store = InMemoryWeightStore(bucket_bytes=64 << 10)
    new_model = build_tiny_model("qwen3", tok, seed=9)
    ref = store.publish(1, model_named_tensors(new_model))

    async def scenario() -> None:
        worker, engine = _worker(tok, coord, store, concurrent_groups=1, partial_rollout=True, partial_rollout_mode=mode)
        await engine.start()
        worker.start()
        await wait_for(lambda: engine.stats()["tokens_generated"] >= 20, what="generation under way")
        coord.push_version(ref)
        await wait_for(lambda: len(coord.submitted) == 1, what="the group")
        assert engine.version == 1
        await worker.stop()
        await engine.close()

    asyncio.run(scenario())
    g = coord.submitted[0]
    prompt = list(g.prompt_token_ids)
    spans = 0
    for r in g.responses:
        assert len(r.token_ids) <= max_tokens
        assert len(r.token_ids) == len(r.logprobs) == len(r.versions)
        assert list(r.versions) == sorted(r.versions)
        if set(r.versions) == {0, 1}:
            spans += 1
            assert r.num_resumes >= 1
            if mode == "abort":
                # Re-prefilled on the new weights: every token after the switch has exactly the
                # logprob the new policy gives it.
                first_new = list(r.versions).index(1)
                ref_lp = reference_logprobs(new_model, prompt, list(r.token_ids), 1.0)
                got = torch.tensor(list(r.logprobs))
                assert (ref_lp[first_new:] - got[first_new:]).abs().max().item() < 1e-4
        assert r.finish_reason != common_pb2.FINISH_REASON_ABORT
    assert spans >= 1, "at least one sample must span the update"
    assert g.min_policy_version == 0 and g.max_policy_version == 1


def test_without_partial_rollout_in_flight_samples_finish_on_old_weights(tok: Any) -> None:
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=60, seed=2)
    coord = FakeCoordinator(_prompts(3), sampling)
    store = InMemoryWeightStore()
    ref = store.publish(1, model_named_tensors(build_tiny_model("qwen3", tok, seed=4)))

    async def scenario() -> None:
        worker, engine = _worker(tok, coord, store, concurrent_groups=1, partial_rollout=False)
        await engine.start()
        worker.start()
        await wait_for(lambda: engine.stats()["tokens_generated"] >= 10, what="generation under way")
        coord.push_version(ref)
        await wait_for(lambda: len(coord.submitted) == 3, what="3 groups")
        await worker.stop()
        await engine.close()

    asyncio.run(scenario())
    for g in coord.submitted:
        assert g.min_policy_version == g.max_policy_version, "no sample mixes versions"
        for r in g.responses:
            assert r.num_resumes == 0
            assert r.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert coord.submitted[0].max_policy_version == 0
    assert coord.submitted[-1].min_policy_version == 1


def test_lost_lease_aborts_its_group_and_drain_returns_unstarted(tok: Any) -> None:
    sampling = common_pb2.SamplingParams(n=4, temperature=1.0, max_tokens=400, seed=3)
    coord = FakeCoordinator(_prompts(4), sampling)

    async def scenario() -> None:
        # 4 slots: the first group fills them, the others wait in the engine (unstarted).
        worker, engine = _worker(tok, coord, InMemoryWeightStore(), concurrent_groups=4, max_num_seqs=4)
        await engine.start()
        worker.start()
        await wait_for(lambda: worker.groups_in_flight == 4 and engine.stats()["tokens_generated"] > 4, what="leases")
        first = min(coord.active)
        coord.lost.add(first)
        await wait_for(lambda: first not in {g for g in worker._groups}, what="lost group aborted")
        returned, finished = await worker.drain(finish_in_flight=True)
        assert returned == 2  # the two groups still waiting for slots
        assert finished == 1  # the running one finished and was submitted
        await worker.stop()
        await engine.close()

    asyncio.run(scenario())
    assert len(coord.returned) == 2
    assert len(coord.submitted) == 1
    assert all(r.finish_reason != common_pb2.FINISH_REASON_ABORT for r in coord.submitted[0].responses)


def test_abort_outputs_are_continued_not_lost(tok: Any) -> None:
    """engine.abort_all() outside the worker's own cancellations counts as an interruption: the
    worker continues the samples, so the group still arrives complete."""
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=80, seed=4)
    coord = FakeCoordinator(_prompts(1), sampling)

    async def scenario() -> None:
        worker, engine = _worker(tok, coord, InMemoryWeightStore(), concurrent_groups=1)
        await engine.start()
        worker.start()
        await wait_for(lambda: engine.stats()["tokens_generated"] >= 10, what="generation under way")
        await engine.abort_all()
        await wait_for(lambda: len(coord.submitted) == 1, what="the group")
        await worker.stop()
        await engine.close()

    asyncio.run(scenario())
    for r in coord.submitted[0].responses:
        assert r.finish_reason != common_pb2.FINISH_REASON_ABORT
        assert len(r.token_ids) <= 80
    assert Finish.ABORT.value == "abort"
