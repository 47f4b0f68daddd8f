"""Adapter-only versions in the rollout engines: the trainer's and the rollout's logprobs agree on
one adapter version, an adapter for another base is refused without a trace, and per-token
versions and partial rollout work across adapter versions as across full weights.

`vllm` runs only in .venv-vllm (marker `vllm`):
    scripts/setup_vllm.sh && PYTHONPATH=$PWD .venv-vllm/bin/python -m pytest -m vllm tests/unit/test_lora_rollout.py
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from services.common.errors import FailedPrecondition
from services.common.tiny import build_tiny_model
from services.rollout.engines import GenerationRequest, SamplingSpec, engine_names
from services.weights import iterate_buckets
from services.weights.adapter import base_identity_of_module, split_descriptor
from tests.lora_helpers import random_adapter
from tests.rollout_helpers import LoopThread, build_engine, reference_logprobs

ENGINES = [pytest.param(name, marks=[pytest.mark.vllm] if name == "vllm" else []) for name in engine_names()]
# vLLM on CPU computes in its own kernels (and LoRA through its punica ops): a looser bound.
TOL = {"transformers": 1e-4, "vllm": 2e-2}


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, model: Any, tok: Any, loop: LoopThread, tmp_path_factory: Any) -> Iterator[Any]:
    kw = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1} if request.param == "vllm" else {}
    eng = build_engine(request.param, model, tok, str(tmp_path_factory.mktemp(f"lora-{request.param}")), **kw)
    loop.run(eng.start(), timeout_s=600)
    yield eng
    loop.run(eng.close())


async def _load(engine: Any, version: int, bucket: Any, mode: str = "abort") -> int:
    await engine.pause(mode)
    try:
        return int(await engine.load_weights(version, iterate_buckets([bucket])))
    finally:
        await engine.resume()


def _prompt(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text))


def test_trainer_and_rollout_logprobs_agree_on_one_adapter_version(engine: Any, tok: Any, loop: LoopThread) -> None:
    """The acceptance check: the fsdp engine trains an adapter, exports the version; the rollout
    loads it and samples; the trainer recomputes the sampled tokens' logprobs (fp32)."""
    from services.trainer.engines.base import EngineSpec, SequenceBatch, get_engine_cls
    from services.trainer.engines.batching import micro_batches_for
    from tests.unit.fsdp_helpers import fixed_batch, make_spec, nll_loss

    base = make_spec(model_extra={"lora_rank": 8, "lora_alpha": 16}, optim={"lr": 2e-2},
                     model_init=lambda: build_tiny_model("qwen3", tok, seed=0))
    spec = EngineSpec(model=base.model, actor=base.actor, device="cpu", total_training_steps=10, model_init=base.model_init)
    trainer: Any = get_engine_cls("fsdp", "cpu").build(spec)
    batch = fixed_batch()
    for _ in range(3):
        trainer.train_step(micro_batches_for(trainer.spec.actor, batch), nll_loss)
    buckets = list(trainer.export_weights(1 << 30))
    version = engine.version + 1

    async def load() -> None:
        await engine.pause("abort")
        try:
            await engine.load_weights(version, iterate_buckets(buckets))
        finally:
            await engine.resume()

    loop.run(load())
    temperature = 0.8
    prompts = [_prompt(tok, t) for t in ("12+34=", "question: 7+8=", "x", "copy 4821:")]
    outs = [loop.run(engine.generate(GenerationRequest(f"agree-{i}", p, SamplingSpec(
        n=4, temperature=temperature, max_tokens=24, seed=11 + i)))) for i, p in enumerate(prompts)]
    rows, lens, got = [], [], []
    for p, samples in zip(prompts, outs, strict=True):
        for s in samples:
            assert set(s.versions) == {version}
            rows.append(p + s.token_ids)
            lens.append(len(p))
            got.extend(s.logprobs)
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)], resp[i, lens[i] : len(r)] = torch.tensor(r), 1, 1
    out = trainer.compute_logprobs(SequenceBatch(ids, attn, resp), temperature=temperature)
    ours = torch.cat([out.logprobs[i, lens[i] : len(r)] for i, r in enumerate(rows)])
    diff = (ours - torch.tensor(got)).abs()
    assert diff.numel() > 50
    if engine.name == "transformers":
        assert float(diff.mean()) < 1e-5, f"mean abs {float(diff.mean()):.2e}, max {float(diff.max()):.2e}"
    else:
        assert float(diff.mean()) < TOL[engine.name] / 4 and float(diff.max()) < 10 * TOL[engine.name]
    # the adapter matters: without it the same tokens have other logprobs
    with trainer.model.disable_adapter():
        plain = trainer.compute_logprobs(SequenceBatch(ids, attn, resp), temperature=temperature)
    assert float((plain.logprobs - out.logprobs).abs().max()) > 1e-2


def test_an_adapter_for_another_base_is_refused_without_a_trace(engine: Any, tok: Any, loop: LoopThread) -> None:
    other = build_tiny_model("qwen3", tok, seed=7)
    bucket, _ = random_adapter(other, seed=1)  # trained on the seed-7 base
    before = engine.version
    prompt = _prompt(tok, "same as before")

    def sample() -> list[float]:
        return loop.run(engine.generate(GenerationRequest("trace", prompt, SamplingSpec(max_tokens=8, temperature=0.0))))[0].logprobs

    first = sample()
    with pytest.raises(FailedPrecondition) as info:
        loop.run(_load(engine, before + 1, bucket))
    assert engine.version == before
    msg = str(info.value)
    theirs = split_descriptor(bucket)[0]
    ours = base_identity_of_module(build_tiny_model("qwen3", tok, seed=0), "builtin").split(":")[1]
    assert theirs is not None and theirs.base_model in msg and ours in msg, msg  # both bases named
    assert FailedPrecondition.code == grpc.StatusCode.FAILED_PRECONDITION
    assert sample() == first, "a refused adapter must change nothing"


def test_the_worker_reports_the_refusal_and_keeps_serving(engine: Any, tok: Any, loop: LoopThread) -> None:
    """UpdateWeights (the worker's update_weights) with an adapter for another base: the error is
    FailedPrecondition (the servicer's FAILED_PRECONDITION), the engine is resumed on its old version."""
    from meshrl.v1 import common_pb2
    from services.rollout.worker import RolloutWorker, WorkerSettings
    from services.weights.in_process import InMemoryWeightStore
    from tests.rollout_helpers import FakeCoordinator, length_scorer

    bucket, _ = random_adapter(build_tiny_model("qwen3", tok, seed=5), seed=4)
    store = InMemoryWeightStore()
    ref = store.publish(engine.version + 1, bucket)
    worker = RolloutWorker(engine, tok, FakeCoordinator([], common_pb2.SamplingParams()), length_scorer, store,
                           WorkerSettings(replica_id="w-refuse"))
    before = engine.version
    with pytest.raises(FailedPrecondition, match="for base model"):
        loop.run(worker.update_weights(ref))
    assert engine.version == before and not engine.paused
    out = loop.run(engine.generate(GenerationRequest("after", _prompt(tok, "ok"), SamplingSpec(max_tokens=4))))
    assert set(out[0].versions) == {before}


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_partial_rollout_across_adapter_versions(engine: Any, model: Any, tok: Any, loop: LoopThread, mode: str) -> None:
    """A sample spanning an adapter update: tokens of both versions in order; where the engine
    re-prefills (abort mode; vLLM with prefix caching in keep mode too) the tokens after the
    switch carry exactly the new adapter's logprobs."""
    from meshrl.v1 import common_pb2
    from services.rollout.worker import RolloutWorker, WorkerSettings
    from services.weights.in_process import InMemoryWeightStore
    from tests.rollout_helpers import FakeCoordinator, length_scorer, wait_for

    base = build_tiny_model("qwen3", tok, seed=0)  # the engine's own copy may carry injected layers
    old_bucket, _ = random_adapter(base, seed=2, scale=0.05)
    new_bucket, new_model = random_adapter(base, seed=3, scale=0.3)
    exact = mode == "abort" or (engine.name == "vllm" and engine.engine_args.get("enable_prefix_caching"))

    async def scenario(attempt: int) -> common_pb2.TrajectoryGroup:
        await _load(engine, engine.version + 1, old_bucket)
        v = engine.version
        store = InMemoryWeightStore()
        ref = store.publish(v + 1, new_bucket)
        prompt = common_pb2.Prompt(prompt_seq=attempt, prompt_id=f"p:{attempt}", text="partial rollout: ")
        sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=150, seed=8 + attempt)
        coord = FakeCoordinator([prompt], sampling, current=common_pb2.WeightsRef(policy_version=v))
        coord.lease_version = v
        worker = RolloutWorker(engine, tok, coord, length_scorer, store, WorkerSettings(
            replica_id="w", concurrent_groups=1, partial_rollout=True, partial_rollout_mode=mode,  # type: ignore[arg-type]
            idle_poll_s=0.05, renew_interval_s=5.0,
        ))
        worker.start()
        await wait_for(lambda: worker.groups_in_flight == 1, what="group in flight")

        def decoding() -> bool:
            live = [r for g in worker._groups.values() for r in g.live]
            return bool(live) and all(engine.request_started(r) for r in live)

        await wait_for(decoding, what="decoding under way")
        await asyncio.sleep(0.02)
        coord.push_version(ref)
        await wait_for(lambda: len(coord.submitted) == 1, timeout_s=180, what="the group")
        await worker.stop()
        return coord.submitted[0]

    spanning = 0
    for attempt in range(4):
        g = loop.run(scenario(attempt))
        before = engine.version - 1
        for r in g.responses:
            assert len(r.token_ids) == len(r.logprobs) == len(r.versions) <= 150
            assert list(r.versions) == sorted(r.versions) and set(r.versions) <= {before, before + 1}
            if set(r.versions) == {before, before + 1}:
                spanning += 1
                if exact:
                    first_new = list(r.versions).index(before + 1)
                    ref_lp = reference_logprobs(new_model, list(g.prompt_token_ids), list(r.token_ids), 1.0)
                    got = torch.tensor(list(r.logprobs))
                    assert (ref_lp[first_new:] - got[first_new:]).abs().max().item() < TOL[engine.name]
        if spanning:
            break
    assert spanning >= 1, "at least one sample must span the update"
