"""Reward edges: a scorer's own TimeoutError is its error (not the deadline's made-up score), a
timed-out DAPO item never outscores a wrong one, one bad result of a batch function fails its item
only, and DAPO's overlong shaping measures a multi-turn response as verl does."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from meshrl.v1 import common_pb2
from services.reward.core import RewardPipeline, ScorerError
from services.reward.custom import CustomFunction
from services.reward.pool import BlockingPool
from services.reward.samples import Sample
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
