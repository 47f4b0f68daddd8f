"""RolloutWorker with the real transformers engine, a hand-written fake coordinator and a simple
real scorer: the loop, updates without partial rollout, lost leases, drain. Partial rollout
(keep / abort) across an update runs for every engine in test_rollout_engine_conformance.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
import torch

from meshrl.v1 import common_pb2
from services.common.tiny import build_tiny_model
from services.rollout.engines import Finish
from services.rollout.engines.transformers_engine import TransformersEngine
from services.rollout.worker import RolloutWorker, WorkerSettings
from services.weights.in_process import InMemoryWeightStore, model_named_tensors
from tests.rollout_helpers import FakeCoordinator, length_scorer, wait_for
from tests.rollout_helpers import chat_prompts as _prompts


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
    sampling = common_pb2.SamplingParams(n=4, temperature=1.0, max_tokens=200, seed=3)
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
        # The freed slots go to one waiting group at the engine's next step; drain after that.
        await wait_for(
            lambda: any(engine.request_started(r) for g in worker._groups.values() for r in g.live),
            what="a waiting group took the freed slots",
        )
        returned, finished = await worker.drain(finish_in_flight=True)
        assert returned == 2  # the two groups still waiting for slots
        assert finished == 1  # the running one finished and was submitted
        await worker.stop()
        await engine.close()

    asyncio.run(scenario())
    assert len(coord.returned) == 2
    assert len(coord.submitted) == 1
    assert all(r.finish_reason != common_pb2.FINISH_REASON_ABORT for r in coord.submitted[0].responses)


def _stop_while_submitting(tok: Any, coord: FakeCoordinator) -> tuple[RolloutWorker, tuple[int, int]]:
    """Run one group until its SubmitGroups call is in flight, call stop() (finish_in_flight=False),
    and let the submit go on only once drain has picked the leases it returns."""

    async def scenario() -> tuple[RolloutWorker, tuple[int, int]]:
        coord.submit_gate = asyncio.Event()
        worker, engine = _worker(tok, coord, InMemoryWeightStore(), concurrent_groups=1)
        await engine.start()
        worker.start()
        await wait_for(lambda: coord.submits_started == 1, what="a submit in flight")
        assert worker.groups_in_flight == 1 and not worker._groups["L0"].live, "no engine request left"
        stopping = asyncio.create_task(worker.stop())
        # drain chooses what to return before its first await; draining is set just before that.
        await wait_for(lambda: worker.draining, what="drain under way")
        coord.submit_gate.set()
        result = await asyncio.wait_for(stopping, 30)
        await engine.close()
        return worker, result

    return asyncio.run(scenario())


def test_stop_during_an_in_flight_submit_submits_the_lease_once_and_returns_nothing(tok: Any) -> None:
    """Was a flake (KeyError in FakeCoordinator.return_leases at stop): a group waiting on its
    batched SubmitGroups call has no engine request left, so drain(finish_in_flight=False) took it
    for an unstarted group and returned its lease while the submit went through."""
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=1)
    coord = FakeCoordinator(_prompts(1), sampling)
    worker, (returned, finished) = _stop_while_submitting(tok, coord)
    assert [g.lease_id for g in coord.submitted] == ["L0"]
    assert coord.returned == []
    assert (returned, finished) == (0, 1)
    assert worker.counters.groups_submitted == 1 and worker.counters.leases_returned == 0


def test_a_submit_failing_during_stop_returns_its_lease_once(tok: Any) -> None:
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=1)
    coord = FakeCoordinator(_prompts(1), sampling)
    coord.submit_error = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, details="bad group")
    worker, (returned, finished) = _stop_while_submitting(tok, coord)
    assert coord.submitted == []
    assert coord.returned == ["L0"], "returned by the failed group's task, not by drain as well"
    assert (returned, finished) == (0, 0)
    assert worker.counters.groups_failed == 1 and worker.counters.leases_returned == 1


class _GatedEngine:
    """Hand-written fake engine: a request runs until the test releases it or it is aborted;
    `on_abort` runs inside abort() (the real engines await there too)."""

    name = "gated"
    version = 0
    paused = False

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Event] = {}
        self.aborted: set[str] = set()
        self.on_abort: Callable[[str], Awaitable[None]] | None = None

    def request_started(self, request_id: str) -> bool:
        return True

    async def generate(self, request: Any) -> list[Any]:
        from services.rollout.engines import SampleOutput

        await self.release.setdefault(request.request_id, asyncio.Event()).wait()
        finish = Finish.ABORT if request.request_id in self.aborted else Finish.LENGTH
        return [SampleOutput(i, [5, 6], [-1.0, -1.0], [0, 0], finish, "ab") for i in range(request.sampling.n)]

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)
        if self.on_abort is not None:
            await self.on_abort(request_id)
        self.release.setdefault(request_id, asyncio.Event()).set()


def _start_gated(engine: _GatedEngine, tok: Any, coord: FakeCoordinator) -> RolloutWorker:
    """A started worker on the gated engine, two groups at a time, no weight fetcher."""
    worker = RolloutWorker(engine, tok, coord, length_scorer, None,  # type: ignore[arg-type]
                           WorkerSettings(replica_id="r0", idle_poll_s=0.05, concurrent_groups=2))
    worker.start()
    return worker


def test_a_group_finishing_while_drain_aborts_another_is_returned_not_submitted(tok: Any) -> None:
    """drain(finish_in_flight=False) picks two generating groups; while it awaits the engine's
    abort of the first, the second one's generation ends. The second must see the drain (no
    submit) and have its lease returned by drain, once."""
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=1)
    coord = FakeCoordinator(_prompts(2), sampling)

    async def scenario() -> tuple[int, int]:
        engine = _GatedEngine()
        worker = _start_gated(engine, tok, coord)
        await wait_for(lambda: set(engine.release) == {"r0/L0", "r0/L1"}, what="two groups generating")
        second = worker._groups["L1"]

        async def finish_the_second(request_id: str) -> None:
            if request_id == "r0/L0":
                engine.release["r0/L1"].set()
                await wait_for(lambda: second.task is not None and second.task.done(), what="the second group's task")

        engine.on_abort = finish_the_second
        return await asyncio.wait_for(worker.stop(), 30)

    returned, finished = asyncio.run(scenario())
    assert coord.submitted == []
    assert sorted(coord.returned) == ["L0", "L1"]
    assert (returned, finished) == (2, 0)


def test_drain_returns_leases_before_the_engine_stops_generating(tok: Any) -> None:
    """A replica being shut down is killed after serve's graceful_shutdown_timeout_s, so drain
    must not hold the prompts while the engine's aborts take their time: here every abort waits
    until the coordinator has both leases back (drain's old order, aborts first, hangs)."""
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=1)
    coord = FakeCoordinator(_prompts(2), sampling)

    engine = _GatedEngine()

    async def scenario() -> tuple[int, int]:
        worker = _start_gated(engine, tok, coord)
        await wait_for(lambda: set(engine.release) == {"r0/L0", "r0/L1"}, what="two groups generating")

        async def slow_abort(request_id: str) -> None:
            await wait_for(lambda: sorted(coord.returned) == ["L0", "L1"], timeout_s=10, what="leases back before the abort ends")

        engine.on_abort = slow_abort
        return await asyncio.wait_for(worker.stop(), 30)

    returned, finished = asyncio.run(scenario())
    assert coord.submitted == [] and sorted(coord.returned) == ["L0", "L1"]
    assert (returned, finished) == (2, 0)
    assert engine.aborted == {"r0/L0", "r0/L1"}, "the engine still stops both groups' requests"


class _SlowLeaseCoordinator(FakeCoordinator):
    """LeasePrompts answers only once `answer` is set: a call can be under way when drain begins."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.answer = asyncio.Event()
        self.calls = 0

    async def lease(self, replica_id: str, max_groups: int) -> Any:
        self.calls += 1
        await self.answer.wait()
        return await super().lease(replica_id, max_groups)


def test_leases_granted_while_drain_begins_are_returned_not_generated(tok: Any) -> None:
    """Shutdown caught the lease loop inside LeasePrompts: the leases it brings back are returned
    by that drain at once (CI once saw them generated after the drain, or held until expiry)."""
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=1)
    coord = _SlowLeaseCoordinator(_prompts(2), sampling)
    engine = _GatedEngine()

    async def scenario() -> tuple[int, int]:
        worker = _start_gated(engine, tok, coord)
        await wait_for(lambda: coord.calls == 1, what="a LeasePrompts call under way")
        stop = asyncio.get_running_loop().create_task(worker.stop())
        await wait_for(lambda: worker.draining, what="the drain begun")
        coord.answer.set()
        return await asyncio.wait_for(stop, 30)

    returned, finished = asyncio.run(scenario())
    assert sorted(coord.returned) == ["L0", "L1"] and coord.active == {}
    assert coord.submitted == []
    assert (returned, finished) == (2, 0)
    assert coord.calls == 1, "no lease asked for after the drain began"


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


def test_failed_group_returns_its_lease_and_bad_input_marks_unhealthy(tok: Any) -> None:
    sampling = common_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=4, seed=1)
    coord = FakeCoordinator(_prompts(1), sampling)

    async def broken_scorer(items: list[Any]) -> list[Any]:
        raise ConnectionError("reward service down")

    async def scenario() -> tuple[bool, bool]:
        model = build_tiny_model("qwen3", tok, seed=0)
        engine = TransformersEngine(model, tok)
        await engine.start()
        worker = RolloutWorker(engine, tok, coord, broken_scorer, None, WorkerSettings(replica_id="r", idle_poll_s=0.05))
        worker.start()
        await wait_for(lambda: len(coord.returned) >= 1, what="the failed group's lease back")
        await worker.drain(finish_in_flight=True)
        healthy_after_drain = worker.healthy
        await worker.stop()
        # An overlong prompt with data.truncation=error is a config problem: the replica says so.
        long_prompt = common_pb2.Prompt(prompt_seq=9, prompt_id="train:9", text="x" * 50)
        coord2 = FakeCoordinator([long_prompt], sampling)
        w2 = RolloutWorker(engine, tok, coord2, length_scorer, None,
                           WorkerSettings(replica_id="r2", idle_poll_s=0.05, max_prompt_length=10))
        w2.start()
        await wait_for(lambda: not w2.healthy, what="unhealthy replica")
        await w2.stop()
        await engine.close()
        return healthy_after_drain, w2.healthy

    healthy_after_drain, healthy_bad = asyncio.run(scenario())
    assert healthy_after_drain and not healthy_bad
    assert coord.submitted == []
    # The lease came back with the reason, on one line: the coordinator counts and reports it.
    assert coord.errors and coord.errors[0] == "ConnectionError: reward service down"


class _ScriptedEngine:
    """Hand-written fake engine: the first request is cut by an update (abort), the continuation
    then produces the given text. Records the requests it saw."""

    name = "scripted"
    version = 0
    paused = False

    def __init__(self, tok: Any, first: str, rest: str) -> None:
        self.tok, self.first, self.rest = tok, first, rest
        self.requests: list[Any] = []

    def request_started(self, request_id: str) -> bool:
        return True

    async def generate(self, request: Any) -> list[Any]:
        from services.rollout.engines import SampleOutput

        self.requests.append(request)
        text, finish = (self.first, Finish.ABORT) if len(self.requests) == 1 else (self.rest, Finish.LENGTH)
        ids = self.tok.encode(text)[: request.sampling.max_tokens]
        return [SampleOutput(0, list(ids), [-1.0] * len(ids), [len(self.requests) - 1] * len(ids), finish, text)]


def test_continuation_respects_max_tokens_and_a_stop_string_across_the_cut(tok: Any) -> None:
    from services.rollout.engines import SamplingSpec

    engine = _ScriptedEngine(tok, first="hello wo", rest="rld! and more")
    worker = RolloutWorker(engine, tok, None, None, None, WorkerSettings(replica_id="s"))  # type: ignore[arg-type]
    prompt = common_pb2.Prompt(prompt_id="p", text="say: ")
    spec = SamplingSpec(n=1, max_tokens=12, stop=("world",))
    group = asyncio.run(worker.generate_group(prompt, spec, score=False))
    assert group is not None
    r = group.responses[0]
    cont = engine.requests[1]
    assert cont.prompt_token_ids == tok.encode("say: ") + tok.encode("hello wo")
    assert cont.sampling.max_tokens == 12 - len("hello wo")
    assert r.text == "hello world", "cut where the stop string completes, text re-decoded"
    assert r.finish_reason == common_pb2.FINISH_REASON_STOP
    assert list(r.versions) == [0] * 8 + [1] * 3
    assert r.num_resumes == 1


class _FlakyStore:
    """Fails the first `failures` fetches (a param server that is not there yet), then serves."""

    def __init__(self, store: InMemoryWeightStore, failures: int) -> None:
        self.store = store
        self.failures = failures
        self.calls = 0

    async def fetch(self, ref: common_pb2.WeightsRef) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("param server unreachable")
        async for bucket in self.store.fetch(ref):
            yield bucket


def test_failed_weight_update_stops_leasing_and_retries_until_loaded(tok: Any) -> None:
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1)
    coord = FakeCoordinator(_prompts(40), sampling)
    store = InMemoryWeightStore()
    ref = store.publish(1, model_named_tensors(build_tiny_model("qwen3", tok, seed=4)))
    flaky = _FlakyStore(store, failures=2)
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        model = build_tiny_model("qwen3", tok, seed=0)
        engine = TransformersEngine(model, tok, max_num_seqs=4)
        settings = WorkerSettings(replica_id="r0", idle_poll_s=0.3, renew_interval_s=0.2, concurrent_groups=1)
        worker = RolloutWorker(engine, tok, coord, length_scorer, flaky, settings)  # type: ignore[arg-type]
        await engine.start()
        worker.start()
        await wait_for(lambda: len(coord.submitted) >= 2, what="generation under way")
        coord.push_version(ref)
        await wait_for(lambda: worker.status().weights_failed, what="the first failed update")
        leased = len(coord.active) + len(coord.submitted)
        # While the weights cannot load, no new prompt is leased (it would only be staler data).
        await asyncio.sleep(0.25)
        seen["leased_while_failed"] = len(coord.active) + len(coord.submitted) - leased
        await wait_for(lambda: engine.version == 1, what="the retried update")
        await wait_for(lambda: len(coord.submitted) >= seen_count() + 2, what="leasing resumed")
        seen["status"] = worker.status()
        await worker.stop()
        await engine.close()

    def seen_count() -> int:
        return int(seen.setdefault("at_load", len(coord.submitted)))

    asyncio.run(scenario())
    assert seen["leased_while_failed"] == 0
    assert flaky.calls == 3 and seen["status"].weight_update_failures == 2
    assert not seen["status"].weights_failed
    assert coord.submitted[-1].min_policy_version == 1


class _BreaksMidStream(_FlakyStore):
    """The first fetch yields one bucket, then fails (a transfer cut mid-version); then serves."""

    async def fetch(self, ref: common_pb2.WeightsRef) -> Any:
        self.calls += 1
        async for bucket in self.store.fetch(ref):
            yield bucket
            if self.calls <= self.failures:
                raise ConnectionError("the stream broke after the first bucket")


def _published_v1(tok: Any) -> tuple[FakeCoordinator, InMemoryWeightStore, common_pb2.WeightsRef]:
    """A run with 40 prompts, and version 1 published in many small buckets (so a stream can break
    after the first)."""
    coord = FakeCoordinator(_prompts(40), common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1))
    store = InMemoryWeightStore(bucket_bytes=4096)
    ref = store.publish(1, model_named_tensors(build_tiny_model("qwen3", tok, seed=4)))
    return coord, store, ref


async def _started(tok: Any, coord: FakeCoordinator, fetcher: Any, idle_poll_s: float) -> tuple[TransformersEngine, RolloutWorker]:
    """A started engine at version 0 and its worker, one group at a time, fetching through FETCHER."""
    engine = TransformersEngine(build_tiny_model("qwen3", tok, seed=0), tok, max_num_seqs=4)
    settings = WorkerSettings(replica_id="r0", idle_poll_s=idle_poll_s, renew_interval_s=0.2, concurrent_groups=1)
    worker = RolloutWorker(engine, tok, coord, length_scorer, fetcher, settings)
    await engine.start()
    worker.start()
    return engine, worker


def test_a_version_loaded_in_part_keeps_generation_paused_until_a_whole_one_loads(tok: Any) -> None:
    """A fetch that fails after some buckets went into the model: resuming would generate with two
    versions' weights under the old one's label. The engine stays paused until the retry loads a
    whole version, then resumes; a fetch that fails before any bucket resumes at once."""
    coord, store, ref = _published_v1(tok)
    assert len(store._versions[1]) > 2
    broken = _BreaksMidStream(store, failures=1)
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        engine, worker = await _started(tok, coord, broken, idle_poll_s=1.0)
        await wait_for(lambda: len(coord.submitted) >= 1, what="generation under way")
        coord.push_version(ref)
        await wait_for(lambda: worker.status().weights_failed, what="the half-loaded update")
        seen["paused_after_failure"] = engine.paused and engine.version == 0
        await wait_for(lambda: engine.version == 1, what="the retried update")
        seen["paused_after_retry"] = engine.paused
        await worker.stop()
        await engine.close()
        # A replica stopped while a half-loaded version keeps it paused stops all the same.
        never = _BreaksMidStream(store, failures=10**6)
        engine, worker = await _started(tok, coord, never, idle_poll_s=1.0)
        coord.push_version(ref)
        await wait_for(lambda: worker.status().weights_failed and engine.paused, what="the paused replica")
        await asyncio.wait_for(worker.stop(), timeout=60)
        await engine.close()

    asyncio.run(scenario())
    assert seen == {"paused_after_failure": True, "paused_after_retry": False}
    assert broken.calls == 2


def test_an_update_weights_rpc_that_loads_in_part_is_retried_until_generation_resumes(tok: Any) -> None:
    """RolloutService.UpdateWeights calls worker.update_weights itself. A transfer that broke
    after a bucket went in left the engine paused "until the retry resumes it", but only the
    WatchVersions path started a retry: nothing resumed, the replica kept leasing, and each group
    it leased waited in the paused engine until its lease expired."""
    coord, store, ref = _published_v1(tok)
    broken = _BreaksMidStream(store, failures=1)
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        engine, worker = await _started(tok, coord, broken, idle_poll_s=0.05)
        await wait_for(lambda: len(coord.submitted) >= 2, what="generation under way")
        with pytest.raises(ConnectionError):
            await worker.update_weights(ref)  # what the UpdateWeights RPC does
        seen["failed"] = worker.status().weights_failed and engine.paused
        await wait_for(lambda: engine.version == 1 and not engine.paused, what="the retried update")
        at = len(coord.submitted)
        await wait_for(lambda: len(coord.submitted) >= at + 2, what="generation after the retry")
        await worker.stop(finish_in_flight=False)
        await engine.close()

    asyncio.run(scenario())
    assert seen == {"failed": True} and broken.calls == 2


def test_a_load_that_timed_out_as_its_version_landed_resumes_generation(tok: Any, monkeypatch: Any) -> None:
    """weight_load_timeout_s fired while the engine's SetVersion was on its way to the scheduler
    thread, which applies it all the same: the engine held the whole new version, but the worker
    took the load as failed in part and kept the engine paused. The retry then found the version
    loaded and stopped without resuming: every group waited forever."""
    from services.rollout.engines import transformers_scheduler as ts

    apply = ts.Scheduler._apply

    def late_set_version(self: Any, command: Any, fut: Any) -> Any:
        if isinstance(command, ts.SetVersion):
            time.sleep(0.6)  # the scheduler thread answers after the load's deadline
        return apply(self, command, fut)

    monkeypatch.setattr(ts.Scheduler, "_apply", late_set_version)
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1)
    coord = FakeCoordinator(_prompts(40), sampling)
    store = InMemoryWeightStore()
    ref = store.publish(1, model_named_tensors(build_tiny_model("qwen3", tok, seed=4)))

    async def scenario() -> None:
        engine = TransformersEngine(build_tiny_model("qwen3", tok, seed=0), tok, max_num_seqs=4)
        settings = WorkerSettings(replica_id="r0", idle_poll_s=0.05, renew_interval_s=0.2, concurrent_groups=1,
                                  weight_load_timeout_s=0.4)
        worker = RolloutWorker(engine, tok, coord, length_scorer, store, settings)
        await engine.start()
        worker.start()
        await wait_for(lambda: len(coord.submitted) >= 2, what="generation under way")
        coord.push_version(ref)
        await wait_for(lambda: worker.counters.weight_update_failures >= 1, what="the timed-out update")
        await wait_for(lambda: engine.version == 1 and not engine.paused, what="generation resumed")
        at = len(coord.submitted)
        await wait_for(lambda: len(coord.submitted) >= at + 2, what="generation after the update")
        assert not worker.status().weights_failed
        await worker.stop(finish_in_flight=False)
        await engine.close()

    asyncio.run(scenario())


def test_an_engine_refusal_after_weights_went_in_keeps_generation_paused(tok: Any) -> None:
    """The transformers engine refused an unknown tensor name (a trainer-side naming mismatch on one
    layer) after earlier buckets, and earlier tensors of the same bucket, were copied in: the
    worker took the refusal for one that changed nothing and resumed, generating on part of
    version 1 labelled version 0. A bucket is now checked whole before it is copied, and a refusal
    after weights went in is not a refusal: generation stays paused."""
    v1 = model_named_tensors(build_tiny_model("qwen3", tok, seed=4))

    class RefusedMidVersion:
        async def fetch(self, ref: common_pb2.WeightsRef) -> Any:
            yield v1[:4]
            yield [v1[4], ("model.layers.0.not_a_weight", torch.zeros(2))]

    coord = FakeCoordinator(_prompts(40), common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1))
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        model = build_tiny_model("qwen3", tok, seed=0)
        before = {n: t.detach().clone() for n, t in model_named_tensors(model)}
        engine = TransformersEngine(model, tok, max_num_seqs=4)
        settings = WorkerSettings(replica_id="r0", idle_poll_s=5.0, renew_interval_s=0.2, concurrent_groups=1)
        worker = RolloutWorker(engine, tok, coord, length_scorer, RefusedMidVersion(), settings)  # type: ignore[arg-type]
        await engine.start()
        worker.start()
        await wait_for(lambda: len(coord.submitted) >= 1, what="generation under way")
        coord.push_version(common_pb2.WeightsRef(policy_version=1))
        await wait_for(lambda: worker.status().weights_failed, what="the refused update")
        now = dict(model.state_dict())
        seen["changed"] = sorted(n for n, _ in v1[:5] if not torch.equal(now[n], before[n]))
        seen["paused"], seen["version"], seen["error"] = engine.paused, engine.version, worker.status().last_error
        await asyncio.wait_for(worker.stop(), 30)
        await engine.close()

    asyncio.run(scenario())
    # bucket 0 went in, bucket 1 (one good tensor, one unknown) changed nothing; paused on that
    assert seen["changed"] == sorted(n for n, _ in v1[:4]) and seen["paused"] and seen["version"] == 0, seen


def test_a_replica_joining_a_live_run_loads_the_current_weights_before_leasing(tok: Any) -> None:
    """A resumed run, a scale-up or a restarted replica starts on the base model while the run is
    at version 7: not one group may be generated with the base weights (it would be trained at
    staleness 7), even when the version stream answers late."""
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1)
    store = InMemoryWeightStore()
    ref = store.publish(7, model_named_tensors(build_tiny_model("qwen3", tok, seed=4)))
    coord = FakeCoordinator(_prompts(6), sampling, current=ref)
    coord.watch_delay_s = 0.3  # leases would be granted long before the first version message
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        worker, engine = _worker(tok, coord, store)
        await engine.start()
        worker.start()
        await asyncio.sleep(0.15)
        seen["leased_before_sync"] = len(coord.active) + len(coord.submitted)
        seen["synced_early"] = worker.status().weights_synced
        await wait_for(lambda: len(coord.submitted) == 6, what="all groups")
        await worker.stop()
        await engine.close()

    asyncio.run(scenario())
    assert seen["leased_before_sync"] == 0 and not seen["synced_early"]
    assert {g.min_policy_version for g in coord.submitted} == {7}


def test_a_group_leased_at_a_version_not_yet_loaded_waits_for_those_weights(tok: Any) -> None:
    """The coordinator committed version 1 and grants leases at it before this replica heard of
    the version: the groups wait for the load instead of generating on version 0 (they would be
    one version staler than the budget that granted them allows). A drain during the wait returns
    the leases; a load that fails gives them back."""
    sampling = common_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1)
    store = InMemoryWeightStore()
    ref = store.publish(1, model_named_tensors(build_tiny_model("qwen3", tok, seed=4)))
    seen: dict[str, Any] = {}

    async def loads_late() -> None:
        coord = FakeCoordinator(_prompts(4), sampling)
        coord.lease_version = 1
        worker, engine = _worker(tok, coord, store, concurrent_groups=2)
        await engine.start()
        worker.start()
        await wait_for(lambda: len(coord.active) == 2, what="two leases")
        await asyncio.sleep(0.3)
        seen["generated_before_load"] = engine.stats()["tokens_generated"]
        coord.push_version(ref)
        await wait_for(lambda: len(coord.submitted) == 4, what="all groups")
        seen["late"] = [g.min_policy_version for g in coord.submitted]
        await worker.stop()
        await engine.close()

    async def drained_while_waiting() -> None:
        coord = FakeCoordinator(_prompts(4), sampling)
        coord.lease_version = 1
        worker, engine = _worker(tok, coord, store, concurrent_groups=2)
        await engine.start()
        worker.start()
        await wait_for(lambda: len(coord.active) == 2, what="two leases")
        seen["drain"] = await worker.drain()
        seen["drain_returned"] = sorted(coord.returned)
        await worker.stop()
        await engine.close()

    async def load_fails() -> None:
        coord = FakeCoordinator(_prompts(2), sampling)
        coord.lease_version = 1
        flaky = _FlakyStore(store, failures=100)
        model = build_tiny_model("qwen3", tok, seed=0)
        engine = TransformersEngine(model, tok, max_num_seqs=4)
        settings = WorkerSettings(replica_id="r0", idle_poll_s=5.0, renew_interval_s=0.2, concurrent_groups=2)
        worker = RolloutWorker(engine, tok, coord, length_scorer, flaky, settings)  # type: ignore[arg-type]
        await engine.start()
        worker.start()
        await wait_for(lambda: len(coord.active) == 2, what="two leases")
        coord.push_version(ref)
        await wait_for(lambda: len(coord.returned) == 2, what="leases given back")
        seen["failed_submitted"] = len(coord.submitted)
        await worker.stop()
        await engine.close()

    asyncio.run(loads_late())
    asyncio.run(drained_while_waiting())
    asyncio.run(load_fails())
    assert seen["generated_before_load"] == 0
    assert seen["late"] == [1, 1, 1, 1]
    assert seen["drain"] == (2, 0) and seen["drain_returned"] == ["L0", "L1"]
    assert seen["failed_submitted"] == 0


def test_one_groups_failing_item_does_not_fail_another_group_coalesced_into_the_same_score_call() -> None:
    """The rollout worker coalesces the score items of groups finishing together into one Score
    request (worker._score_batcher). The reward service fails a request when any of its items
    failed (a user function raising on one response), so group B, whose items all score fine,
    fails with group A's error: its lease is given back with A's error and its rollouts thrown away."""
    from meshrl.v1 import reward_pb2
    from services.common.errors import MeshError
    from services.reward.servicer import RewardServicer

    def fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        if solution_str == "bad":
            raise ValueError("cannot parse")
        return 1.0

    from services.reward.core import RewardPipeline
    from services.reward.custom import CustomFunction
    from services.reward.pool import BlockingPool

    pipeline = RewardPipeline(custom=CustomFunction("m:fn", fn, is_async=False), pool=BlockingPool(1), item_timeout_s=30)
    servicer = RewardServicer(pipeline)

    async def scorer(items: list[reward_pb2.ScoreItem]) -> list[reward_pb2.ScoreResult]:
        return list((await servicer.score_request(reward_pb2.ScoreRequest(items=items))).results)

    worker = RolloutWorker(None, None, None, scorer, None,  # type: ignore[arg-type]
                           WorkerSettings(replica_id="r0", batch_window_s=0.05))

    def items(lease: str, texts: list[str]) -> list[reward_pb2.ScoreItem]:
        return [reward_pb2.ScoreItem(item_id=f"{lease}/{i}", data_source="d", response_text=t) for i, t in enumerate(texts)]

    async def go() -> list[Any]:
        return await asyncio.gather(worker._score(items("A", ["bad", "ok"])), worker._score(items("B", ["ok", "ok"])),
                                    return_exceptions=True)

    a, b = asyncio.run(go())
    assert isinstance(a, MeshError), f"group A: {a!r}"
    assert not isinstance(b, BaseException), f"group B (all items fine) failed with group A's error: {b!r}"
    assert [r.item_id for r in b] == ["B/0", "B/1"] and [r.score for r in b] == [1.0, 1.0]


def test_an_update_to_the_loaded_version_does_not_resume_a_half_loaded_model(tok: Any) -> None:
    """After a version loaded in part, the engine holds two versions' weights under the old one's
    label: an UpdateWeights for a version it already has (an operator re-sending the version
    GetRolloutStatus shows, a retried RPC) must not resume generation on them."""
    coord, store, ref = _published_v1(tok)
    never = _BreaksMidStream(store, failures=10**6)
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        engine, worker = await _started(tok, coord, never, idle_poll_s=30.0)
        await wait_for(lambda: len(coord.submitted) >= 1, what="generation under way")
        coord.push_version(ref)
        await wait_for(lambda: worker.status().weights_failed and engine.paused, what="the half-loaded update")
        seen["load_s"] = await worker.update_weights(common_pb2.WeightsRef(policy_version=engine.version))
        seen["paused"] = engine.paused
        seen["version"] = engine.version
        await asyncio.wait_for(worker.stop(), timeout=60)
        await engine.close()

    asyncio.run(scenario())
    assert seen == {"load_s": 0.0, "paused": True, "version": 0}


class _BreaksThenUnreachable(_FlakyStore):
    """The first fetch yields one bucket, then fails; every later one fails before any bucket."""

    async def fetch(self, ref: common_pb2.WeightsRef) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise ConnectionError("param server unreachable")
        async for bucket in self.store.fetch(ref):
            yield bucket
            raise ConnectionError("the stream broke after the first bucket")


def test_a_retry_that_fails_before_any_bucket_keeps_a_half_loaded_model_paused(tok: Any) -> None:
    """A retry of a version loaded in part that fails before its first bucket changes nothing in
    the model, which still holds two versions: generation stays paused."""
    coord, store, ref = _published_v1(tok)
    broken = _BreaksThenUnreachable(store, failures=0)
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        engine, worker = await _started(tok, coord, broken, idle_poll_s=0.05)
        await wait_for(lambda: len(coord.submitted) >= 1, what="generation under way")
        coord.push_version(ref)
        await wait_for(lambda: broken.calls >= 3, what="two retries that failed before any bucket")
        seen["paused"] = engine.paused
        seen["version"] = engine.version
        await asyncio.wait_for(worker.stop(), timeout=60)
        await engine.close()

    asyncio.run(scenario())
    assert seen == {"paused": True, "version": 0}
