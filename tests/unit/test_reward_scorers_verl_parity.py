"""Built-in scorers and routing against verl's verl/utils/reward_score (HEAD) on the same inputs."""

from __future__ import annotations

import pytest

from services.reward import scorers
from services.reward.scorers import gsm8k


@pytest.mark.parametrize(
    ("response", "truth", "verl_score"),
    [
        # verl: re.findall(...)[-1] -- the LAST "#### <number>" is the answer
        ("#### 5 then #### 72", "72", 1.0),
        ("#### 72\n#### 73", "72", 0.0),
        # verl clips the response to its last 300 characters before matching
        ("#### 72" + " blah" * 80, "72", 0.0),
        ("x" * 400 + "#### 72", "72", 1.0),
    ],
)
def test_gsm8k_matches_verl_last_answer_in_tail(response: str, truth: str, verl_score: float) -> None:
    assert gsm8k.compute_score("openai/gsm8k", response, truth)["score"] == verl_score


@pytest.mark.parametrize("data_source", ["math", "math_dapo_reasoning"])
def test_verl_math_dapo_sources_route_to_math_dapo(data_source: str) -> None:
    # verl default_compute_score: data_source in ["math_dapo", "math", "math_dapo_reasoning"] -> math_dapo
    spec = scorers.find(data_source)
    assert spec is not None and spec.name == "math_dapo"


@pytest.mark.parametrize("is_async", [False, True])
def test_a_number_returned_per_item_is_also_acc_as_in_verl(is_async: bool) -> None:
    """verl's per-item reward managers (reward loop naive/dapo, DAPORewardManager): a result that is
    not a dict gives reward_extra_info["acc"] = score (what algorithm.filter_groups.metric=acc reads)."""
    import asyncio

    from services.reward.core import RewardPipeline
    from services.reward.custom import CustomFunction
    from services.reward.samples import Sample

    if is_async:
        async def fn(**kw):
            return 1.0
    else:
        def fn(**kw):
            return 1.0
    p = RewardPipeline(custom=CustomFunction("m:fn", fn, is_async=is_async))
    try:
        (out,) = asyncio.run(p.score([Sample("i", "my/task", "resp", "gt")]))
    finally:
        asyncio.run(p.close())
    assert out.score == 1.0 and out.metrics.get("acc") == 1.0
