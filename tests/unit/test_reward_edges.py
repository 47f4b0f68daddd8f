"""Reward edges: a scorer's own TimeoutError is its error (not the deadline's made-up score), a
timed-out DAPO item never outscores a wrong one, one bad result of a batch function fails its item
only, DAPO's overlong shaping measures a multi-turn response as verl does, a user function's own
CancelledError or sys.exit() fails its item only, and an endpoint's refused batch scored again item
by item is counted once."""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import pytest

from meshrl.v1 import common_pb2
from services.reward.core import RewardPipeline, ScorerError
from services.reward.custom import CustomFunction
from services.reward.pool import BlockingPool
from services.reward.samples import Sample, Score
from services.reward.shaping import OverlongShaping
from services.rollout import convert


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def sample(i: int | str, ds: str, response: str, truth: str = "", **kw: Any) -> Sample:
    return Sample(item_id=str(i), data_source=ds, response=response, ground_truth=truth, **kw)


# ---- a scorer's own TimeoutError ------------------------------------------------------------------


def test_sync_custom_function_raising_timeout_error_is_an_error_not_a_zero_reward() -> None:
    """A user function that calls a judge and gets socket.timeout (== TimeoutError) fails at once:
    that is the scorer's exception, not the pipeline's deadline. It must be a ScorerError."""

    def fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        raise TimeoutError("judge did not answer")  # socket.timeout is TimeoutError since 3.10

    # reward.scorer_processes=false: blocking scorers on the BlockingPool threads
    p = RewardPipeline(custom=CustomFunction("m:fn", fn, is_async=False), pool=BlockingPool(1), item_timeout_s=30)
    outcomes = run(p.score_each([sample("a", "d", "x")]))
    assert isinstance(outcomes[0], ScorerError), f"got {outcomes[0]!r}"


def test_async_custom_function_raising_timeout_error_is_an_error_not_a_zero_reward() -> None:
    async def fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        raise TimeoutError("judge HTTP call timed out")

    p = RewardPipeline(custom=CustomFunction("m:afn", fn, is_async=True), item_timeout_s=30)
    outcomes = run(p.score_each([sample("a", "d", "x")]))
    assert isinstance(outcomes[0], ScorerError), f"got {outcomes[0]!r}"


def test_batch_custom_function_raising_timeout_error_is_an_error_not_a_zero_reward() -> None:
    async def fn(data_sources: list[str], solution_strs: list[str], ground_truths: list[str], extra_infos: Any) -> list[float]:
        raise TimeoutError("batch judge timed out")  # e.g. aiohttp's ServerTimeoutError is a TimeoutError

    p = RewardPipeline(custom=CustomFunction("m:b", fn, is_async=True, batched=True), item_timeout_s=30)
    outcomes = run(p.score_each([sample("a", "d", "x"), sample("b", "d", "y")]))
    assert all(isinstance(o, ScorerError) for o in outcomes), f"got {outcomes!r}"


# ---- DAPO overlong length of a multi-turn trajectory ----------------------------------------------


def test_multi_turn_overlong_penalty_counts_the_whole_response_like_verl() -> None:
    """verl's DAPO manager measures L = attention_mask[response].sum(), which counts tool/env
    tokens too (they have attention_mask 1, response_mask 0), against the same response budget
    that the agent loop fills with policy + env tokens. A trajectory that used the whole budget
    (10 policy + 10 env tokens, max_tokens 20, buffer 8) gets -penalty_factor in verl."""
    resp = common_pb2.Response(
        sample_index=0, token_ids=list(range(20)), logprobs=[0.0] * 20, versions=[1] * 10 + [-1] * 10,
        loss_mask=[1] * 10 + [0] * 10, final_text="68", text="...", num_turns=2,
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
    )
    # the same, opened by 3 environment tokens (the rest of this sample's own first prompt, which
    # verl's prompt would hold): not counted
    rest = common_pb2.Response(
        sample_index=1, token_ids=list(range(23)), logprobs=[0.0] * 23, versions=[-1] * 3 + [1] * 10 + [-1] * 10,
        loss_mask=[0] * 3 + [1] * 10 + [0] * 10, final_text="68", text="...", num_turns=2,
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
    )
    g = common_pb2.TrajectoryGroup(lease_id="L", prompt=common_pb2.Prompt(data_source="meshrl/addition", ground_truth="68"))
    g.responses.extend([resp, rest])
    items = convert.score_items(g, "23+45=", max_tokens=20)
    assert [len(it.response_token_ids) for it in items] == [20, 20]
    samples = [Sample(item_id=it.item_id, data_source=it.data_source, response=it.response_text,
                      ground_truth=it.ground_truth, response_token_ids=it.response_token_ids,
                      max_response_length=it.max_response_length) for it in items]
    p = RewardPipeline(stages=[OverlongShaping(buffer_len=8, penalty_factor=1.0, default_max_length=20, log=True)])
    scores = run(p.score(samples))
    # verl: min(-(20 - (20 - 8)) / 8 * 1.0, 0) = -1.0 -> reward 1 + (-1) = 0
    assert scores[0].metrics["overlong_reward"] == scores[1].metrics["overlong_reward"] == -1.0, scores


# ---- a timed-out DAPO (+1/-1) item ----------------------------------------------------------------


def test_timed_out_math_dapo_item_does_not_outscore_a_wrong_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """math_dapo's convention is +1 correct / -1 otherwise. A Math-Verify call past item_timeout_s
    scores a flat 0 (the math_verify 1/0 convention), so a response that makes the verifier hang
    gets a higher reward than a wrong answer in the same group."""
    import services.reward.scorers.math as m

    release = threading.Event()
    real_check = m.check

    def check(solution_str: str, ground_truth: str) -> tuple[bool, bool, bool]:
        if "hang" in solution_str:
            release.wait(10)
        return real_check(solution_str, ground_truth)

    monkeypatch.setattr(m, "check", check)
    p = RewardPipeline(pool=BlockingPool(2), item_timeout_s=0.3)  # no process pool: the patch applies
    try:
        scores = run(p.score([sample("wrong", "math_dapo", "\\boxed{3}", "4"), sample("slow", "math_dapo", "hang", "4")]))
    finally:
        release.set()
    assert scores[0].score == -1.0
    assert scores[1].metrics.get("timeout") == 1.0
    assert scores[1].score <= scores[0].score, f"timed out {scores[1].score} > wrong {scores[0].score}"


# ---- one bad result of a batch reward function -----------------------------------------------------


def test_one_non_finite_result_of_a_batch_function_fails_only_that_item() -> None:
    """The deployment scores many rollout replicas' requests in one pipeline call, and a batch
    custom function is called once for all of them. When it returns a good score for item 0 and
    NaN for item 1, only item 1 (its request) should fail; item 0's request is someone else's."""

    def fn(data_sources: list[str], solution_strs: list[str], ground_truths: list[str], extra_infos: Any) -> list[float]:
        return [1.0 if s == "ok" else float("nan") for s in solution_strs]

    p = RewardPipeline(custom=CustomFunction("m:b", fn, is_async=False, batched=True), item_timeout_s=30)
    outcomes = run(p.score_each([sample("req1/0", "d", "ok"), sample("req2/0", "d", "bad")]))
    assert isinstance(outcomes[1], ScorerError)
    assert not isinstance(outcomes[0], Exception), f"item 0 got {outcomes[0]!r}"
    assert outcomes[0].score == 1.0


def test_async_custom_function_raising_its_own_cancelled_error_fails_only_its_item() -> None:
    """An async judge whose HTTP library leaks a CancelledError (its own, nobody cancelled the
    pipeline) on one item: that item is an error; the other items (other rollout replicas'
    requests in the Serve batch) still get their scores, and the failure is counted."""

    async def fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        if solution_str == "bad":
            raise asyncio.CancelledError("judge client cancelled its own request")
        return 1.0

    p = RewardPipeline(custom=CustomFunction("m:afn", fn, is_async=True), item_timeout_s=30)

    async def go() -> Any:
        try:
            return await p.score_each([sample("a", "d", "bad"), sample("b", "d", "good")])
        except BaseException as exc:
            return exc

    outcomes = run(go())
    assert isinstance(outcomes, list), f"score_each raised {outcomes!r}: the whole batch is lost"
    assert isinstance(outcomes[0], ScorerError) and isinstance(outcomes[1], Score)
    assert p.status()["items_failed"] == 1


def test_sync_custom_function_calling_sys_exit_on_a_thread_does_not_kill_the_event_loop() -> None:
    """reward.scorer_processes=false: a user function that calls sys.exit() (or exit()) on a bad
    input must fail that item, not propagate SystemExit out of the replica's event loop."""

    def fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        if solution_str == "bad":
            sys.exit(1)
        return 1.0

    p = RewardPipeline(custom=CustomFunction("m:fn", fn, is_async=False), pool=BlockingPool(1), item_timeout_s=30)
    try:
        outcomes = run(p.score_each([sample("a", "d", "bad"), sample("b", "d", "good")]))
    except SystemExit:
        raise AssertionError("SystemExit from a user reward function escaped the event loop") from None
    assert isinstance(outcomes[0], ScorerError) and isinstance(outcomes[1], Score)


def test_remote_endpoint_refusal_fallback_does_not_double_count_items_scored() -> None:
    """A batch refused with INVALID_ARGUMENT is scored again one item at a time to find the bad
    item. Items whose chunk had already been scored are then counted twice in the endpoint's
    `items_scored` (status()/metrics), though each was scored for one item."""
    import grpc

    from examples.reward_server import server as example
    from services.common.config.reward import RewardEndpointConfig
    from services.reward.core import RemoteRoute
    from services.reward.endpoints import EndpointClient

    class Picky(example.RewardService):
        async def Score(self, request: Any, context: Any) -> Any:
            if any(it.response_text == "bad" for it in request.items):
                await asyncio.sleep(0.2)  # the good chunk's reply comes first
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "items[0].response_text: bad")
            return await super().Score(request, context)

    async def go() -> tuple[list[Any], dict[str, Any]]:
        import grpc.aio

        from meshrl.v1 import reward_pb2_grpc

        srv = grpc.aio.server()
        reward_pb2_grpc.add_RewardServiceServicer_to_server(Picky(), srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        try:
            client = EndpointClient(RewardEndpointConfig(address=f"127.0.0.1:{port}", batch_size=1, data_sources=["d"]))
            p = RewardPipeline(remotes=[RemoteRoute(client, frozenset({"d"}))])
            out = await p.score_each([sample("g", "d", "#### 1", "1"), sample("b", "d", "bad")])
            st = p.status()["endpoints"][0]
            await p.close()
            return out, st
        finally:
            await srv.stop(0)

    outcomes, st = run(go())
    assert isinstance(outcomes[0], Score) and outcomes[0].score == 1.0
    assert st["items_scored"] == 1, f"endpoint items_scored={st['items_scored']} for 1 item scored"
