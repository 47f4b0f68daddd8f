"""The engine contract, run against every registered rollout engine (services/rollout/engines).

`vllm` runs only in .venv-vllm (marker `vllm`):
    scripts/setup_vllm.sh && PYTHONPATH=$PWD .venv-vllm/bin/python -m pytest -m vllm tests/unit/test_rollout_engine_conformance.py
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.common.tiny import build_tiny_model
from services.rollout.engines import Finish, GenerationRequest, SamplingSpec, engine_names
from services.weights import iterate_buckets
from services.weights.in_process import model_named_tensors
from tests.rollout_helpers import LoopThread, build_engine, reference_logprobs

ENGINES = [pytest.param(name, marks=[pytest.mark.vllm] if name == "vllm" else []) for name in engine_names()]
# vLLM on CPU computes in its own kernels (and may reorder reductions): a looser bound.
TOL = {"transformers": 1e-4, "vllm": 2e-2}


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, model: Any, tok: Any, loop: LoopThread, tmp_path_factory: Any) -> Iterator[Any]:
    eng = build_engine(request.param, model, tok, str(tmp_path_factory.mktemp(f"engine-{request.param}")))
    loop.run(eng.start(), timeout_s=600)
    yield eng
    loop.run(eng.close())


def _prompt(tok: Any, text: str = "question: 12+13=") -> list[int]:
    return list(tok.encode(text))


def test_logprobs_are_temperature_scaled_before_truncation(engine: Any, model: Any, tok: Any, loop: LoopThread) -> None:
    prompt = _prompt(tok)
    spec = SamplingSpec(n=3, temperature=0.7, top_k=8, top_p=0.9, max_tokens=24, seed=11)
    outs = loop.run(engine.generate(GenerationRequest("lp", prompt, spec)))
    assert [o.index for o in outs] == [0, 1, 2]
    for o in outs:
        assert len(o.token_ids) == len(o.logprobs) == len(o.versions) > 0
        ref = reference_logprobs(model, prompt, o.token_ids, 0.7)
        diff = (ref - torch.tensor(o.logprobs)).abs().max().item()
        assert diff < TOL[engine.name], f"sample {o.index}: max |logprob - reference| = {diff}"
        # Truncation shapes sampling only: the reported value is not renormalised over the kept set,
        # so it is strictly below the truncated distribution's (which would be >= the full one).
        assert all(lp <= 0 for lp in o.logprobs)
        assert set(o.versions) == {engine.version}


def test_greedy_reports_untempered_logprobs(engine: Any, model: Any, tok: Any, loop: LoopThread) -> None:
    prompt = _prompt(tok, "abc")
    outs = loop.run(engine.generate(GenerationRequest("greedy", prompt, SamplingSpec(n=2, temperature=0.0, max_tokens=12))))
    a, b = outs
    assert a.token_ids == b.token_ids
    ids = torch.tensor([prompt + a.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    assert a.token_ids == logits.argmax(-1).tolist()
    ref = reference_logprobs(model, prompt, a.token_ids, 0.0)
    assert (ref - torch.tensor(a.logprobs)).abs().max().item() < TOL[engine.name]


def test_n_samples_max_tokens_and_seeds(engine: Any, tok: Any, loop: LoopThread) -> None:
    prompt = _prompt(tok, "hello")
    spec = SamplingSpec(n=4, temperature=1.0, max_tokens=7, seed=123)
    first = loop.run(engine.generate(GenerationRequest("n1", prompt, spec)))
    again = loop.run(engine.generate(GenerationRequest("n2", prompt, spec)))
    assert len(first) == 4
    for o in first:
        assert 0 < len(o.token_ids) <= 7
        assert o.finish_reason in (Finish.LENGTH, Finish.STOP)
        if o.finish_reason == Finish.LENGTH:
            assert len(o.token_ids) == 7
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    assert [o.token_ids for o in first] == [o.token_ids for o in again], "same seed, same samples"
    assert len({tuple(o.token_ids) for o in first}) > 1, "samples of one request must differ"


def test_stop_sequence_ends_the_sample(engine: Any, tok: Any, loop: LoopThread) -> None:
    prompt = _prompt(tok, "xyz")
    greedy = loop.run(engine.generate(GenerationRequest("g", prompt, SamplingSpec(temperature=0.0, max_tokens=16))))[0]
    text = tok.decode(greedy.token_ids, skip_special_tokens=True)
    stop = text[4:6]
    assert len(stop) == 2
    cut = text.index(stop) + len(stop)
    out = loop.run(
        engine.generate(GenerationRequest("s", prompt, SamplingSpec(temperature=0.0, max_tokens=16, stop=(stop,))))
    )[0]
    assert out.finish_reason == Finish.STOP
    assert out.text == text[:cut], "the stop string is the end of the text (included)"
    assert out.token_ids == greedy.token_ids[: len(out.token_ids)]


def test_abort_returns_partial_tokens(engine: Any, tok: Any, loop: LoopThread) -> None:
    async def scenario() -> list[Any]:
        task = asyncio.create_task(
            engine.generate(GenerationRequest("long", _prompt(tok), SamplingSpec(max_tokens=200, seed=1)))
        )
        await asyncio.sleep(0)  # let generate() register the request (unknown ids count as started)
        while not engine.request_started("long") and not task.done():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert await engine.abort("long")
        return await asyncio.wait_for(task, 60)

    outs = loop.run(scenario())
    o = outs[0]
    assert o.finish_reason in (Finish.ABORT, Finish.STOP)
    assert len(o.token_ids) == len(o.logprobs) == len(o.versions) < 200


def test_on_token_sees_each_token_as_it_is_sampled(engine: Any, tok: Any, loop: LoopThread) -> None:
    """The gateway's `stream: true` forwards tokens through `on_token`: every token, in order, with
    its logprob, while the request is still running (an abort from the first callback cuts it)."""
    seen: list[tuple[int, int, float]] = []
    aborted: list[bool] = []

    async def scenario() -> list[Any]:
        loop_ = asyncio.get_running_loop()
        cut: list[asyncio.Task[bool]] = []

        def on_token(index: int, token_id: int, logprob: float) -> None:
            seen.append((index, token_id, logprob))
            if len(seen) == 1:
                cut.append(loop_.create_task(engine.abort("streamed")))

        req = GenerationRequest("streamed", _prompt(tok), SamplingSpec(max_tokens=200, seed=3), on_token=on_token)
        outs = await asyncio.wait_for(engine.generate(req), 60)
        aborted.extend([await cut[0]] if cut else [])
        return outs

    o = loop.run(scenario())[0]
    assert [(i, t) for i, t, _ in seen] == [(0, t) for t in o.token_ids]
    assert [lp for _, _, lp in seen] == pytest.approx(o.logprobs)
    assert aborted == [True], "the first token reached on_token only after the request had ended"
    assert o.finish_reason in (Finish.ABORT, Finish.STOP) and len(o.token_ids) < 200


def test_abort_all_returns_every_request_partial(engine: Any, tok: Any, loop: LoopThread) -> None:
    async def scenario() -> tuple[dict[str, Any], list[Any]]:
        tasks = [
            asyncio.create_task(engine.generate(GenerationRequest(f"all{i}", _prompt(tok), SamplingSpec(n=2, max_tokens=300, seed=i))))
            for i in range(2)
        ]
        await asyncio.sleep(0)  # let generate() register the requests (unknown ids count as started)
        while not all(engine.request_started(f"all{i}") for i in range(2)):
            await asyncio.sleep(0.01)
        partial = await engine.abort_all()
        return partial, await asyncio.wait_for(asyncio.gather(*tasks), 60)

    partial, results = loop.run(scenario())
    assert set(partial) == {"all0", "all1"}
    for i, outs in enumerate(results):
        assert [o.token_ids for o in partial[f"all{i}"]] == [o.token_ids for o in outs]
        assert len(outs) == 2
        for o in outs:
            assert len(o.token_ids) == len(o.logprobs) == len(o.versions) < 300
            assert o.finish_reason in (Finish.ABORT, Finish.STOP)


def test_pause_load_resume_tags_tokens_with_versions(engine: Any, model: Any, tok: Any, loop: LoopThread) -> None:
    new_model = build_tiny_model("qwen3", tok, seed=7)
    old_version = engine.version

    async def scenario() -> Any:
        task = asyncio.create_task(
            engine.generate(GenerationRequest("span", _prompt(tok), SamplingSpec(max_tokens=160, seed=3, temperature=1.0)))
        )
        await asyncio.sleep(0)
        while not engine.request_started("span"):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await engine.pause("keep")
        loaded = await engine.load_weights(old_version + 1, iterate_buckets([model_named_tensors(new_model)]))
        await engine.resume()
        return loaded, await asyncio.wait_for(task, 120)

    try:
        loaded, outs = loop.run(scenario())
        assert loaded > 0
        assert engine.version == old_version + 1
        o = outs[0]
        assert len(o.token_ids) <= 160
        assert o.versions == sorted(o.versions), "versions never go back"
        assert set(o.versions) <= {old_version, old_version + 1}
        if o.finish_reason == Finish.LENGTH:
            assert old_version + 1 in o.versions
        # A fresh request sees the new weights only: its logprobs match a forward pass of them.
        prompt = _prompt(tok, "fresh")
        fresh = loop.run(engine.generate(GenerationRequest("fresh", prompt, SamplingSpec(max_tokens=10, seed=5))))[0]
        assert set(fresh.versions) == {old_version + 1}
        ref = reference_logprobs(new_model, prompt, fresh.token_ids, 1.0)
        assert (ref - torch.tensor(fresh.logprobs)).abs().max().item() < TOL[engine.name]
    finally:
        async def restore() -> None:
            await engine.pause("abort")
            await engine.load_weights(old_version + 2, iterate_buckets([model_named_tensors(model)]))
            await engine.resume()

        loop.run(restore())


def test_cancelled_callers_leave_the_engine_serving(engine: Any, tok: Any, loop: LoopThread) -> None:
    """A group task cancelled at any point of generate() (a drain, a lost lease, a replica going
    down) must not take the engine with it: cancel callers while their requests are being added,
    queued and decoded, then the engine still answers a full request."""

    async def scenario() -> tuple[list[Any], bool]:
        busy = asyncio.create_task(
            engine.generate(GenerationRequest("busy", _prompt(tok), SamplingSpec(max_tokens=120, seed=2)))
        )
        await asyncio.sleep(0.05)
        for i in range(12):
            t = asyncio.create_task(
                engine.generate(GenerationRequest(f"cancel-{i}", _prompt(tok, f"{i}+{i}="),
                                                  SamplingSpec(n=2, max_tokens=60, seed=i)))
            )
            # Cancelled at different points of its life: while its request is being added (the
            # first await), queued, or decoding.
            await asyncio.sleep(0)
            if i % 3:
                await asyncio.sleep(0.004 * i)
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await asyncio.wait_for(busy, 120)
        # Nothing of the cancelled requests is left behind: abort_all has nothing to wait for.
        assert await asyncio.wait_for(engine.abort_all(), 30) == {}
        after = await asyncio.wait_for(
            engine.generate(GenerationRequest("after", _prompt(tok), SamplingSpec(n=2, max_tokens=16, seed=3))), 120
        )
        return after, (await engine.health()).healthy

    outs, healthy = loop.run(scenario())
    assert healthy
    assert len(outs) == 2 and all(len(o.token_ids) > 0 for o in outs)


def test_health_and_stats(engine: Any, loop: LoopThread) -> None:
    assert loop.run(engine.health()).healthy
    stats = engine.stats()
    assert stats["tokens_generated"] > 0
    assert all(isinstance(v, float) for v in stats.values())


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_partial_rollout_through_the_worker(engine: Any, model: Any, tok: Any, loop: LoopThread, mode: str) -> None:
    """A sample spanning a weight update: tokens of both versions, length within max_tokens, and
    (where the engine re-prefills: abort mode; vLLM with prefix caching in keep mode too) the
    tokens after the switch carry exactly the new weights' logprobs."""
    from meshrl.v1 import common_pb2
    from services.rollout.worker import RolloutWorker, WorkerSettings
    from services.weights.in_process import InMemoryWeightStore
    from tests.rollout_helpers import FakeCoordinator, length_scorer, wait_for

    new_model = build_tiny_model("qwen3", tok, seed=21)
    exact = mode == "abort" or (engine.name == "vllm" and engine.engine_args.get("enable_prefix_caching"))

    async def scenario(attempt: int) -> common_pb2.TrajectoryGroup:
        v = engine.version
        store = InMemoryWeightStore()
        ref = store.publish(v + 1, model_named_tensors(new_model))
        prompt = common_pb2.Prompt(prompt_seq=attempt, prompt_id=f"p:{attempt}", text="partial rollout: ")
        sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=150, seed=8 + attempt)
        coord = FakeCoordinator([prompt], sampling)
        worker = RolloutWorker(engine, tok, coord, length_scorer, store, WorkerSettings(
            replica_id="w", concurrent_groups=1, partial_rollout=True, partial_rollout_mode=mode,  # type: ignore[arg-type]
            idle_poll_s=0.05, renew_interval_s=5.0,
        ))
        worker.start()
        await wait_for(lambda: worker.groups_in_flight == 1, what="group in flight")
        # Push the update once the samples are being decoded (a fixed sleep was longer than a
        # whole 150-token sample of vLLM on a fast CPU: nothing spanned the update).
        def decoding() -> bool:
            live = [r for g in worker._groups.values() for r in g.live]
            return bool(live) and all(engine.request_started(r) for r in live)

        await wait_for(decoding, what="decoding under way")
        await asyncio.sleep(0.02)
        coord.push_version(ref)
        await wait_for(lambda: len(coord.submitted) == 1, timeout_s=180, what="the group")
        await worker.stop()
        return coord.submitted[0]

    async def restore() -> None:
        await engine.pause("abort")
        await engine.load_weights(engine.version + 1, iterate_buckets([model_named_tensors(model)]))
        await engine.resume()

    # A sample may end (EOS) before the update lands; a few attempts make a spanning one certain.
    spanning = 0
    for attempt in range(4):
        before = engine.version
        try:
            g = loop.run(scenario(attempt))
        finally:
            loop.run(restore())
        for r in g.responses:
            assert len(r.token_ids) == len(r.logprobs) == len(r.versions) <= 150
            assert list(r.versions) == sorted(r.versions)
            assert set(r.versions) <= {before, before + 1}
            assert r.finish_reason != common_pb2.FINISH_REASON_ABORT
            assert r.text == tok.decode(list(r.token_ids), skip_special_tokens=True)
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


class _EchoEnvironment:
    """A scripted environment for the multi-turn contract: answers turn k with a tool message,
    done after turn `done_at` (an Environment by shape; the engines do not know environments)."""

    name = "echo"

    def __init__(self, done_at: int = 3) -> None:
        self.done_at = done_at

    async def start(self, session_id: str, prompt: Any, *, sample_index: int = 0, policy_version: int = 0) -> Any:
        from services.environment.base import StartResult

        return StartResult()

    async def step(self, session_id: str, turn: int, assistant_text: str, tool_calls: Any, *, policy_version: int = 0) -> Any:
        from services.environment.base import Message, StepResult

        return StepResult(messages=(Message("tool", f"ok {turn}"),), done=turn >= self.done_at)

    async def close(self, session_id: str) -> Any:
        from services.environment.base import CloseResult

        return CloseResult()

    async def aclose(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"name": self.name}


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_multi_turn_continues_from_exact_ids_across_updates(engine: Any, model: Any, tok: Any, loop: LoopThread, mode: str) -> None:
    """Multi-turn trajectories through the worker's agent loop: every turn is generated from exactly
    the ids so far (the policy tokens' logprobs match a forward pass over the whole trajectory, the
    environment tokens included), environment tokens are masked with version -1, and a weight
    update between or inside turns gives policy versions that never go back (with abort, the
    re-prefilled tokens after the update carry exactly the new weights' logprobs)."""
    from meshrl.v1 import common_pb2
    from services.environment.factory import EnvironmentRouter
    from services.rollout.agent.loop import AgentLoop, AgentSettings
    from services.rollout.worker import RolloutWorker, WorkerSettings
    from services.weights.in_process import InMemoryWeightStore
    from tests.rollout_helpers import FakeCoordinator, length_scorer, wait_for

    new_model = build_tiny_model("qwen3", tok, seed=33)
    # The transformers engine loads weights into the very module it was given (the `model`
    # fixture): keep a copy of the weights the old tokens came from.
    base = copy.deepcopy(model)
    before = engine.version
    store = InMemoryWeightStore()
    ref = store.publish(before + 1, model_named_tensors(new_model))

    async def scenario() -> common_pb2.TrajectoryGroup:
        prompt = common_pb2.Prompt(prompt_seq=1, prompt_id="mt:1")
        prompt.messages.add(role="user", content="count with me:")
        # Digits end a turn: a random tiny model writes one every ~10 tokens.
        sampling = common_pb2.SamplingParams(n=3, temperature=1.0, max_tokens=160, seed=41, stop=list("0123456789"))
        coord = FakeCoordinator([prompt], sampling)
        agent = AgentLoop(tok, EnvironmentRouter(_EchoEnvironment(), []), AgentSettings(max_prompt_length=64))  # type: ignore[arg-type]
        worker = RolloutWorker(engine, tok, coord, length_scorer, store, WorkerSettings(
            replica_id="mt", concurrent_groups=1, partial_rollout=True, partial_rollout_mode=mode,  # type: ignore[arg-type]
            idle_poll_s=0.05, renew_interval_s=5.0,
        ), agent=agent)
        worker.start()
        await wait_for(lambda: engine.stats()["tokens_generated"] > 0 and worker.groups_in_flight == 1, what="generation")
        await wait_for(lambda: agent.counters.environment_turns >= 1, what="a first environment turn")
        coord.push_version(ref)
        await wait_for(lambda: len(coord.submitted) == 1, timeout_s=180, what="the group")
        await worker.stop()
        return coord.submitted[0]

    try:
        g = loop.run(scenario())
    finally:
        async def restore() -> None:
            await engine.pause("abort")
            await engine.load_weights(engine.version + 1, iterate_buckets([model_named_tensors(model)]))
            await engine.resume()

        loop.run(restore())
    prompt_ids = list(g.prompt_token_ids)
    assert tok.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    multi = spanning = 0
    for r in g.responses:
        mask, ids, vers, lps = list(r.loss_mask), list(r.token_ids), list(r.versions), list(r.logprobs)
        assert len(mask) == len(ids) == len(vers) == len(lps) <= 160
        assert all(v == -1 and lp == 0.0 for v, lp, m in zip(vers, lps, mask, strict=True) if not m)
        policy = [v for v, m in zip(vers, mask, strict=True) if m]
        assert policy == sorted(policy) and set(policy) <= {before, before + 1}
        assert r.num_turns == sum(1 for s in r.turn_starts if mask[s]) >= 1
        if 0 in mask:
            multi += 1
            env_text = tok.decode([x for x, m in zip(ids, mask, strict=True) if not m])
            assert "<|im_start|>tool\nok 0<|im_end|>" in env_text
        # Exact ids: the logprobs of the old weights' tokens match one forward pass over
        # prompt + trajectory, whatever came between the turns.
        old = [i for i, (m, v) in enumerate(zip(mask, vers, strict=True)) if m and v == before]
        ref_old = reference_logprobs(base, prompt_ids, ids, 1.0)
        if old:
            assert (ref_old[old] - torch.tensor(lps)[old]).abs().max().item() < TOL[engine.name]
        new = [i for i, (m, v) in enumerate(zip(mask, vers, strict=True)) if m and v == before + 1]
        spanning += bool(old and new)
        if new and mode == "abort":
            ref_new = reference_logprobs(new_model, prompt_ids, ids, 1.0)
            assert (ref_new[new] - torch.tensor(lps)[new]).abs().max().item() < TOL[engine.name]
    assert multi >= 1, "at least one trajectory had an environment turn"
    # the update landed mid-trajectory somewhere: otherwise the checks above saw one version only
    assert spanning >= 1, f"no trajectory has tokens of both versions ({len(g.responses)} played)"
