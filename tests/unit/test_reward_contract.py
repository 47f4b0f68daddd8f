"""Reward pieces with no network: request/response validation, the circuit breaker, backoff and
the endpoint config rules."""

from __future__ import annotations

import asyncio
import random

import pytest
from pydantic import ValidationError

from meshrl.v1 import reward_pb2 as pb
from services.common.config.reward import RewardEndpointConfig, RewardServiceConfig
from services.common.endpoints import BreakerState, CircuitBreaker, backoff_s
from services.common.errors import BadReply, InvalidArgument
from services.reward import convert
from services.reward.samples import Sample

# ---- request validation --------------------------------------------------------------------------


def item(i: str, **kw: object) -> pb.ScoreItem:
    return pb.ScoreItem(item_id=i, data_source="meshrl/addition", response_text="1", ground_truth="1", **kw)  # type: ignore[arg-type]


def test_items_decode() -> None:
    samples = convert.samples_from_items(
        [item("a", extra_info_json='{"k": 1}', response_token_ids=[5, 6], max_response_length=9, truncated=True)],
        max_items=10,
    )
    s = samples[0]
    assert (s.item_id, s.extra_info, s.response_length, s.max_response_length, s.truncated) == ("a", {"k": 1}, 2, 9, True)
    assert convert.sample_from_item(convert.item_from_sample(s), "x") == s  # round trip


@pytest.mark.parametrize(
    ("items", "field", "reason"),
    [
        ([item("")], "items[0].item_id", "non-empty"),
        ([item("a"), item("a")], "items[1].item_id", "repeats items[0]"),
        ([item("a", extra_info_json="{bad")], "items[0].extra_info_json", "not valid JSON"),
        ([item("a", extra_info_json="[1]")], "items[0].extra_info_json", "JSON object"),
        ([item(str(i)) for i in range(4)], "items", "max_items_per_request=3"),
        ([item("x" * 300)], "items[0].item_id", "longer than"),
    ],
)
def test_bad_items_name_the_field(items: list[pb.ScoreItem], field: str, reason: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        convert.samples_from_items(items, max_items=3)
    assert err.value.field == field
    assert reason in err.value.reason


# ---- what an endpoint sends back -----------------------------------------------------------------

SAMPLES = [Sample("a", "d", "x"), Sample("b", "d", "y")]


@pytest.mark.parametrize(
    ("results", "reason"),
    [
        ([pb.ScoreResult(item_id="a", score=1.0)], "returned 1 results for 2 items"),
        ([pb.ScoreResult(item_id="b"), pb.ScoreResult(item_id="a")], "expected 'a'"),
        ([pb.ScoreResult(item_id="a", score=float("nan")), pb.ScoreResult(item_id="b")], "score is nan"),
        ([pb.ScoreResult(item_id="a", metrics={"m": float("inf")}), pb.ScoreResult(item_id="b")], "not finite"),
    ],
)
def test_garbage_responses_are_the_endpoints_fault_naming_it(results: list[pb.ScoreResult], reason: str) -> None:
    """BadReply, never InvalidArgument: the reward service batches many replicas' requests, and a
    rollout replica stops on InvalidArgument (bad input that would fail anywhere)."""
    with pytest.raises(BadReply) as err:
        convert.scores_from_response(pb.ScoreResponse(results=results), SAMPLES, "reward endpoint 'judge'")
    assert not isinstance(err.value, InvalidArgument)
    assert err.value.source == "reward endpoint 'judge'"
    assert reason in err.value.reason


def test_good_response() -> None:
    resp = pb.ScoreResponse(results=[pb.ScoreResult(item_id="a", score=1.0, metrics={"acc": 1.0}), pb.ScoreResult(item_id="b")])
    scores = convert.scores_from_response(resp, SAMPLES, "ep")
    assert [(s.item_id, s.score, dict(s.metrics)) for s in scores] == [("a", 1.0, {"acc": 1.0}), ("b", 0.0, {})]


# ---- circuit breaker and backoff -----------------------------------------------------------------


def test_breaker_opens_probes_and_closes() -> None:
    async def go() -> None:
        b = CircuitBreaker(failure_threshold=2, open_s=0.05, max_open_s=0.2)
        assert await b.acquire() is False
        b.on_failure()
        assert b.state is BreakerState.CLOSED
        b.on_failure()
        assert b.state is BreakerState.OPEN and b.down_since is not None
        # Two callers wait; exactly one becomes the probe once open_s has passed.
        t1 = asyncio.ensure_future(b.acquire())
        t2 = asyncio.ensure_future(b.acquire())
        done, pending = await asyncio.wait({t1, t2}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and next(iter(done)).result() is True
        assert b.state is BreakerState.HALF_OPEN
        b.on_failure()  # the probe failed: open again, for twice as long
        assert b.state is BreakerState.OPEN and b.open_s == pytest.approx(0.1)
        waiter = next(iter(pending))
        assert await asyncio.wait_for(waiter, 5) is True  # the other caller probes next
        b.on_success()
        assert b.state is BreakerState.CLOSED and b.consecutive_failures == 0 and b.down_since is None
        assert b.open_s == pytest.approx(0.05)

    asyncio.run(go())


def test_breaker_open_period_is_capped_and_a_lost_probe_is_released() -> None:
    async def go() -> None:
        b = CircuitBreaker(failure_threshold=1, open_s=0.01, max_open_s=0.02)
        b.trip()
        for _ in range(3):
            assert await asyncio.wait_for(b.acquire(), 5) is True
            b.on_failure()
        assert b.open_s == pytest.approx(0.02)
        assert await asyncio.wait_for(b.acquire(), 5) is True
        b.release_probe()  # the probe was cancelled: the next caller may probe at once
        assert b.state is BreakerState.OPEN
        assert await asyncio.wait_for(b.acquire(), 0.5) is True

    asyncio.run(go())


def test_backoff_is_full_jitter_and_capped() -> None:
    rng = random.Random(0)
    for attempt in range(1, 12):
        bound = min(5.0, 0.1 * 2 ** (attempt - 1))
        draws = [backoff_s(attempt, 0.1, 5.0, rng) for _ in range(50)]
        assert all(0 <= d <= bound for d in draws)
        assert max(draws) > bound / 2  # really spread over the range


# ---- config rules --------------------------------------------------------------------------------


def test_endpoint_config_rules() -> None:
    with pytest.raises(ValidationError, match="host:port"):
        RewardEndpointConfig(address="localhost")
    with pytest.raises(ValidationError, match="set tls: true"):
        RewardEndpointConfig(address="h:1", ca_file="ca.pem")
    with pytest.raises(ValidationError, match="already routed"):
        RewardServiceConfig(
            endpoints=[
                RewardEndpointConfig(address="h:1", data_sources=["a"]),
                RewardEndpointConfig(address="h:2", data_sources=["a"]),
            ]
        )
    with pytest.raises(ValidationError, match="catch-all"):
        RewardServiceConfig(endpoints=[RewardEndpointConfig(address="h:1"), RewardEndpointConfig(address="h:2")])
    with pytest.raises(ValidationError, match="distinct names"):
        RewardServiceConfig(
            endpoints=[RewardEndpointConfig(address="h:1", data_sources=["a"]), RewardEndpointConfig(address="h:1", data_sources=["b"])]
        )
    assert RewardEndpointConfig(address="h:1", name="judge").label == "judge"


def test_errors_survive_pickling() -> None:
    """Ray moves a replica's exception to the Serve proxy by pickling it."""
    import pickle

    from services.common.errors import MissingDependency

    err = pickle.loads(pickle.dumps(InvalidArgument("items[2].data_source", "no scorer")))
    assert (err.field, err.reason, str(err)) == ("items[2].data_source", "no scorer", "items[2].data_source: no scorer")
    assert str(pickle.loads(pickle.dumps(MissingDependency("math-verify", "pip install math-verify")))).startswith("math-verify")


def test_serve_options_from_the_config() -> None:
    """serve.reward becomes Serve deployment options that Serve itself accepts (no Ray needed)."""
    from services.common.config import load_config
    from services.reward.deployment import RewardDeployment, deployment_options

    cfg = load_config(
        None,
        ["serve.reward.num_cpus=2", "serve.reward.resources={NPU: 1}",
         "serve.reward.autoscaling={min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}"],
    )
    opts = deployment_options(cfg.serve.reward)
    assert opts["ray_actor_options"] == {"num_cpus": 2.0, "resources": {"NPU": 1.0}}
    assert opts["autoscaling_config"]["max_replicas"] == 4 and "num_replicas" not in opts
    RewardDeployment.options(**opts)  # type: ignore[attr-defined]  # Serve validates the options
    fixed = deployment_options(load_config(None, ["serve.reward.num_replicas=3"]).serve.reward)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
