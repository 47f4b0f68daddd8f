"""The reward pipeline without Ray or gRPC: routing, custom functions (verl files unchanged),
normalisation, timeouts, errors, DAPO overlong shaping."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.config import load_config
from services.common.errors import ConfigError, InvalidArgument, MeshError, Unavailable
from services.reward.core import RemoteRoute, RewardPipeline, ScorerError, normalize
from services.reward.custom import CustomFunction, load_custom_function
from services.reward.factory import build_pipeline
from services.reward.pool import BlockingPool
from services.reward.samples import Sample, Score
from services.reward.shaping import OverlongShaping, overlong_penalty

FIXTURE = Path(__file__).parent / "reward_fixtures" / "verl_style_reward.py"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def sample(i: int | str, ds: str, response: str, truth: str = "", **kw: Any) -> Sample:
    return Sample(item_id=str(i), data_source=ds, response=response, ground_truth=truth, **kw)


class FakeRemote:
    """A hand-written RemoteScorer: scores len(response), or raises `error`."""

    def __init__(self, name: str, error: MeshError | None = None) -> None:
        self.name = name
        self.error = error
        self.seen: list[str] = []

    async def score(self, samples: Sequence[Sample]) -> list[Score]:
        self.seen.extend(s.item_id for s in samples)
        if self.error is not None:
            raise self.error
        return [Score(s.item_id, float(len(s.response)), {"remote": 1.0}) for s in samples]

    def status(self) -> dict[str, Any]:
        return {"name": self.name}

    async def close(self) -> None:
        pass


# ---- routing -------------------------------------------------------------------------------------


def test_routing_precedence() -> None:
    explicit, catch_all = FakeRemote("explicit"), FakeRemote("catch_all")
    remotes = [RemoteRoute(explicit, frozenset({"openai/gsm8k"})), RemoteRoute(catch_all)]
    p = RewardPipeline(remotes=remotes)
    assert p.route_name("openai/gsm8k") == "explicit"  # an endpoint that lists it beats the built-in
    assert p.route_name("meshrl/addition") == "synthetic"  # built-in
    assert p.route_name("my/task") == "catch_all"  # nothing else takes it
    custom = CustomFunction("mine", lambda **kw: 1.0, is_async=False)
    p2 = RewardPipeline(custom=custom, remotes=remotes)
    assert p2.route_name("openai/gsm8k") == "explicit"
    assert p2.route_name("meshrl/addition") == "mine"  # the custom function takes the rest, as in verl
    assert RewardPipeline().route_name("my/task") is None


def test_unroutable_item_is_rejected_naming_the_field() -> None:
    p = RewardPipeline()
    with pytest.raises(InvalidArgument) as err:
        p.validate([sample(0, "meshrl/addition", "1"), sample(1, "my/task", "x")])
    assert err.value.field == "items[1].data_source"
    assert "custom_reward_function.path" in str(err.value) and "reward.endpoints" in str(err.value)


def test_mixed_batch_scores_every_route_in_order() -> None:
    remote = FakeRemote("ext")
    p = RewardPipeline(remotes=[RemoteRoute(remote, frozenset({"ext/task"}))])
    items = [
        sample("a", "meshrl/addition", "68</s>", "68"),
        sample("b", "ext/task", "hello"),
        sample("c", "openai/gsm8k", "#### 7", "7"),
        sample("d", "lighteval/MATH", "\\boxed{\\frac{1}{2}}", "0.5"),
        sample("e", "ext/task", "hi"),
    ]
    scores = run(p.score(items))
    assert [s.item_id for s in scores] == ["a", "b", "c", "d", "e"]
    assert [s.score for s in scores] == [1.0, 5.0, 1.0, 1.0, 2.0]
    assert remote.seen == ["b", "e"]  # one call with both remote items
    assert scores[1].metrics == {"remote": 1.0, "score": 5.0}
    assert p.status()["items_scored"] == 5


def test_remote_error_fails_only_its_items() -> None:
    down = FakeRemote("down", error=Unavailable("reward endpoint 'down' is down"))
    p = RewardPipeline(remotes=[RemoteRoute(down, frozenset({"ext/task"}))])
    outcomes = run(p.score_each([sample("a", "meshrl/copy", "12", "12"), sample("b", "ext/task", "x")]))
    assert isinstance(outcomes[0], Score) and outcomes[0].score == 1.0
    assert isinstance(outcomes[1], Unavailable)
    with pytest.raises(Unavailable):
        run(p.score([sample("b", "ext/task", "x")]))


class PickyRemote(FakeRemote):
    """Refuses (INVALID_ARGUMENT) any call that holds the item "bad", as an endpoint does."""

    async def score(self, samples: Sequence[Sample]) -> list[Score]:
        self.seen.extend(s.item_id for s in samples)
        if any(s.item_id == "bad" for s in samples):
            raise InvalidArgument(f"reward endpoint '{self.name}'", "rejected the Score request: items[1].response: too long")
        return [Score(s.item_id, float(len(s.response)), {"remote": 1.0}) for s in samples]


def test_an_endpoint_refusing_a_batch_fails_only_the_item_it_refused() -> None:
    """The deployment merges rollout replicas' requests into one batch; a replica stops on
    InvalidArgument, so a refusal must reach only the request whose item was refused."""
    picky = PickyRemote("judge")
    p = RewardPipeline(remotes=[RemoteRoute(picky, frozenset({"ext/task"}))])
    items = [sample("a", "ext/task", "xx"), sample("bad", "ext/task", "y"), sample("c", "ext/task", "zzz")]
    outcomes = run(p.score_each(items))
    assert [o.score if isinstance(o, Score) else type(o).__name__ for o in outcomes] == [2.0, "InvalidArgument", 3.0]
    assert sorted(picky.seen) == sorted(["a", "bad", "c", "a", "bad", "c"])  # the batch, then each alone
    assert p._totals.by_route["judge"] == 3  # each item counted once, not again when scored alone


# ---- custom functions (verl signature) -----------------------------------------------------------


def test_verl_style_file_used_unchanged() -> None:
    cfg = load_config(None, [f"custom_reward_function.path={FIXTURE}"])
    p = build_pipeline(cfg)
    items = [
        sample("right", "any/source", "think... <answer>42</answer>", "42"),
        sample("wrong", "any/source", "<answer>41</answer>", "42"),
        sample("malformed", "any/source", "42", "42"),
        sample("hard", "any/source", "<answer>42</answer>", "42", extra_info={"difficulty": "hard"}),
    ]
    p.validate(items)
    scores = run(p.score(items))
    assert [s.score for s in scores] == [1.0, 0.0, -1.0, 1.5]
    assert scores[0].metrics == {"score": 1.0, "acc": 1.0}  # bool acc -> 1.0; the string "pred" is not a metric
    assert scores[2].metrics["acc"] == 0.0
    run(p.close())


def test_custom_function_reward_kwargs_and_module_path() -> None:
    cfg = load_config(
        None,
        [f"custom_reward_function.path={FIXTURE}", "custom_reward_function.name=compute_score_scaled",
         "custom_reward_function.reward_kwargs={scale: 2.0}"],
    )
    p = build_pipeline(cfg)
    assert run(p.score([sample(0, "x", "<answer>7</answer>", "7")]))[0].score == 2.0
    # An importable module works too (here: the built-in GSM8K scorer, which has verl's signature).
    fn = load_custom_function("services.reward.scorers.gsm8k", "compute_score")
    p2 = RewardPipeline(custom=fn)
    assert run(p2.score([sample(0, "whatever", "#### 5", "5")]))[0].score == 1.0


def test_custom_function_load_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"custom_reward_function\.path=.*no such file"):
        load_custom_function(str(tmp_path / "missing.py"))
    with pytest.raises(ConfigError, match=r"custom_reward_function\.name='nope'.*compute_score"):
        load_custom_function(str(FIXTURE), "nope")
    with pytest.raises(ConfigError, match="not an importable module"):
        load_custom_function("no_such_module_xyz")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(ConfigError, match="failed to import: RuntimeError: boom at import"):
        load_custom_function(str(broken))


@pytest.mark.parametrize(
    ("raw", "score", "metrics"),
    [
        (1, 1.0, {"score": 1.0}),
        (True, 1.0, {"score": 1.0}),
        (0.25, 0.25, {"score": 0.25}),
        ((0.5, "extra"), 0.5, {"score": 0.5}),
        ({"score": 2, "acc": True, "pred": "x", "len": 3}, 2.0, {"score": 2.0, "acc": 1.0, "len": 3.0}),
    ],
)
def test_normalize_accepts_verl_results(raw: Any, score: float, metrics: dict[str, float]) -> None:
    out = normalize(raw, "fn", sample("i", "d", ""))
    assert out.score == score and dict(out.metrics) == metrics


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"acc": 1.0}, "without 'score'"),
        (float("nan"), "non-finite"),
        ({"score": float("inf")}, "non-finite"),
        ("1.0", "return a number"),
        (None, "return a number"),
    ],
)
def test_normalize_rejects_non_rewards(raw: Any, match: str) -> None:
    with pytest.raises(ScorerError, match=match) as err:
        normalize(raw, "my_fn", sample("item-7", "ds", ""))
    assert "my_fn" in str(err.value) and "item-7" in str(err.value)


def test_scorer_exception_fails_that_item_with_context() -> None:
    def fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        if solution_str == "bad":
            raise KeyError("missing")
        return 1.0

    p = RewardPipeline(custom=CustomFunction("mod:fn", fn, is_async=False))
    outcomes = run(p.score_each([sample("ok", "d", "fine"), sample("x", "d", "bad")]))
    assert isinstance(outcomes[0], Score)
    assert isinstance(outcomes[1], ScorerError)
    assert "mod:fn raised KeyError" in str(outcomes[1]) and "'x'" in str(outcomes[1])


# ---- timeouts ------------------------------------------------------------------------------------


def test_blocking_scorer_timeout_scores_zero_and_frees_the_pool() -> None:
    release = threading.Event()

    def fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
        if solution_str == "hang":
            release.wait(30)
        return 1.0

    pool = BlockingPool(1)
    p = RewardPipeline(custom=CustomFunction("m:fn", fn, is_async=False), pool=pool, item_timeout_s=0.3)

    async def go() -> list[Score]:
        return await p.score([sample("h", "d", "hang"), sample("a", "d", "ok"), sample("b", "d", "ok")])

    scores = run(go())
    assert [s.score for s in scores] == [0.0, 1.0, 1.0]  # one worker, yet the hung call blocked nobody
    assert scores[0].metrics == {"score": 0.0, "timeout": 1.0}
    assert p.status()["items_timed_out"] == 1 and pool.abandoned == 1
    assert p.unhealthy_reason() is None
    release.set()
    deadline = time.monotonic() + 10
    while pool.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.abandoned == 0
    pool.close()


def test_abandoned_threads_make_the_pipeline_unhealthy() -> None:
    release = threading.Event()
    p = RewardPipeline(
        custom=CustomFunction("m:fn", lambda **kw: release.wait(30), is_async=False),
        pool=BlockingPool(2), item_timeout_s=0.05, max_abandoned_threads=1,
    )
    run(p.score([sample(i, "d", "x") for i in range(2)]))
    assert "2 abandoned scorer threads" in (p.unhealthy_reason() or "")
    release.set()


def test_async_custom_function_is_awaited_with_a_deadline() -> None:
    async def fn(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> dict[str, float]:
        if solution_str == "slow":
            await asyncio.sleep(30)
        return {"score": float(solution_str == ground_truth)}

    p = RewardPipeline(custom=CustomFunction("m:afn", fn, is_async=True), item_timeout_s=0.2)
    scores = run(p.score([sample(0, "d", "7", "7"), sample(1, "d", "slow", "7")]))
    assert scores[0].score == 1.0
    assert scores[1].score == 0.0 and scores[1].metrics["timeout"] == 1.0


# ---- DAPO overlong shaping -----------------------------------------------------------------------


@given(
    length=st.integers(0, 4096), max_len=st.integers(1, 4096), buf=st.integers(1, 4096),
    factor=st.floats(0, 10, allow_nan=False),
)
def test_overlong_penalty_is_verls_formula(length: int, max_len: int, buf: int, factor: float) -> None:
    expected = min(-(length - (max_len - buf)) / buf * factor, 0)
    got = overlong_penalty(length, max_len, buf, factor)
    assert got == pytest.approx(expected)
    assert got <= 0
    if length <= max_len - buf:
        assert got == 0


def test_overlong_stage_in_the_pipeline() -> None:
    cfg = load_config(
        None,
        ["data.max_response_length=20", "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=8",
         "reward_model.overlong_buffer.penalty_factor=1.0", "reward_model.overlong_buffer.log=true"],
    )
    p = build_pipeline(cfg)
    assert [s.name for s in p.stages] == ["overlong_buffer"]
    items = [
        sample("short", "meshrl/addition", "68", "68", response_token_ids=[1] * 12),  # at M - B: no penalty
        sample("long", "meshrl/addition", "68", "68", response_token_ids=[1] * 16),  # half-way: -0.5
        sample("cap", "meshrl/addition", "1", "68", response_token_ids=[1] * 20),  # at the cap, wrong: -1
        sample("own", "meshrl/addition", "68", "68", response_token_ids=[1] * 10, max_response_length=10),
    ]
    p.validate(items)
    scores = run(p.score(items))
    assert [s.score for s in scores] == [1.0, 0.5, -1.0, 1.0 - 8 / 8]
    assert scores[1].metrics["overlong_reward"] == -0.5 and scores[1].metrics["overlong"] == 1.0
    assert scores[1].metrics["score"] == 1.0  # the scorer's own score, before shaping
    assert scores[0].metrics["overlong"] == 0.0


def test_overlong_needs_token_counts_and_a_long_enough_cap() -> None:
    p = RewardPipeline(stages=[OverlongShaping(buffer_len=8, penalty_factor=1.0, default_max_length=20, log=False)])
    with pytest.raises(InvalidArgument) as err:
        p.validate([sample(0, "meshrl/addition", "68", "68")])
    assert err.value.field == "items[0].response_token_ids"
    with pytest.raises(InvalidArgument) as err:
        p.validate([sample(0, "meshrl/addition", "68", "68", response_token_ids=[1], max_response_length=4)])
    assert err.value.field == "items[0].max_response_length"
    p.validate([sample(0, "meshrl/addition", "", "68")])  # an empty response has 0 tokens: fine


def test_verl_batch_reward_function() -> None:
    cfg = load_config(
        None,
        [f"custom_reward_function.path={FIXTURE}", "custom_reward_function.name=compute_score_batch",
         "reward_model.reward_manager=batch"],
    )
    p = build_pipeline(cfg)
    items = [sample(i, "any", f"<answer>{i % 2}</answer>", "1") for i in range(5)]
    scores = run(p.score(items))
    assert [s.score for s in scores] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert all(s.metrics["batch_size"] == 5 for s in scores)  # one call for the whole batch

    wrong_len = CustomFunction("m:b", lambda **kw: [1.0], is_async=False, batched=True)
    outcomes = run(RewardPipeline(custom=wrong_len).score_each(items[:2]))
    assert all(isinstance(o, ScorerError) and "returned 1 results for 2 items" in str(o) for o in outcomes)


def test_a_cancelled_blocking_scorer_call_does_not_make_the_next_item_time_out() -> None:
    """A caller cancelled while its scorer runs (a client deadline on the plain RewardServer, a
    drained LocalScorer) frees its slot, and the thread is abandoned like a timeout's: counted for
    the health check, and the next call runs on a fresh executor instead of queueing behind it
    and "timing out" unrun (a made-up score of 0)."""
    release = threading.Event()

    def score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
        if solution_str == "slow":
            release.wait(10)
        return 1.0

    async def go() -> None:
        pipeline = RewardPipeline(
            custom=CustomFunction(name="f", fn=score, is_async=False),  # source None: the thread pool
            pool=BlockingPool(1), item_timeout_s=0.5,
        )
        try:
            first = asyncio.ensure_future(pipeline.score([Sample("a", "x", "slow")]))
            await asyncio.sleep(0.1)
            first.cancel()  # the request's deadline passed
            with contextlib.suppress(asyncio.CancelledError):
                await first
            abandoned = pipeline.pool.abandoned
            (s,) = await pipeline.score([Sample("b", "x", "fast")])
            assert s.score == 1.0 and "timeout" not in s.metrics, f"scored {s} without running the scorer"
            assert abandoned == 1, "a scorer thread still running after its caller left is not counted"
        finally:
            release.set()
            pipeline.pool.close()

    asyncio.run(go())


def test_a_rejected_score_request_leaves_no_route_cache_entry() -> None:
    """A data_source nothing scores is refused and not cached: keyed by caller input, such entries
    would fill the bounded route cache and leave good sources uncached."""
    pipeline = RewardPipeline()
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.data_source"):
        pipeline.validate([Sample("a", "junk/not-a-source", "x")])
    assert "junk/not-a-source" not in pipeline._routes
