"""FSDP engine across two gloo ranks (torch.multiprocessing on 127.0.0.1) against one rank:
data parallel (packed and padded, unequal micro-batch counts) and Ulysses SP=2 give the same
logprobs, gradients (per parameter) and grad norms. One spawn runs every scenario to keep the
suite small on a 2-core machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.engines.batching import micro_batches_for
from tests.unit.fsdp_helpers import (
    GRAD_PROBE_OPTIM,
    build,
    fixed_batch,
    make_spec,
    nll_loss,
    run_ranks,
    run_scenario,
)

PROBE = {"optim": GRAD_PROBE_OPTIM, "grad_clip": 1e9}
SCENARIOS: dict[str, dict[str, Any]] = {
    "dp2_packed": {**PROBE, "remove_padding": True},
    "dp2_padded_uneven": {**PROBE, "remove_padding": False, "micro": 1, "num_seqs": 3},
    "sp2_packed": {**PROBE, "remove_padding": True, "sp": 2},
    "sp2_padded": {**PROBE, "remove_padding": False, "sp": 2, "micro": 2},
}


# a checkpoint written by one rank (a plain, unsharded module) resumed by two (sharded)
RESUME = {"remove_padding": True, "optim": {"lr": 1e-3}}


@pytest.fixture(scope="module")
def one_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine = build(make_spec(**RESUME))
    assert not engine.sharded  # type: ignore[attr-defined]
    for _ in range(2):  # AdamW moments and the step count are in the checkpoint
        engine.train_step(micro_batches_for(engine.spec.actor, fixed_batch()), nll_loss)  # type: ignore[attr-defined]
    path = tmp_path_factory.mktemp("ckpt") / "one_rank"
    engine.save_checkpoint(path)
    engine.close()
    return path


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, one_rank_checkpoint: Path) -> list[dict[str, Any]]:
    scenarios = {**SCENARIOS, "resume_dp2": {**RESUME, "load": str(one_rank_checkpoint)}}
    return run_ranks(2, scenarios, tmp_path_factory.mktemp("ranks"))


@pytest.fixture(scope="module")
def one_rank() -> dict[int, dict[str, Any]]:
    """World-size-1 references for the 4- and 3-sequence batches."""
    out = {}
    for n in (4, 3):
        engine = build(make_spec(**PROBE, remove_padding=True))
        out[n] = run_scenario(engine, fixed_batch(num_seqs=n))
        engine.close()
    return out


def _joined(ranks: list[dict[str, Any]], name: str, key: str, sp: int) -> torch.Tensor:
    """Per-token results of every DP rank put back into batch order."""
    parts = [r[name] for r in ranks[::sp]]
    rows = sum(len(p["index"]) for p in parts)
    width = max(p[key].shape[1] for p in parts)
    out = torch.zeros(rows, width)
    for p in parts:
        out[torch.as_tensor(p["index"], dtype=torch.long), : p[key].shape[1]] = p[key]
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_match_one_rank(name: str, two_ranks: list[dict[str, Any]], one_rank: dict[int, dict[str, Any]]) -> None:
    sp = SCENARIOS[name].get("sp", 1)
    ref = one_rank[SCENARIOS[name].get("num_seqs", 4)]
    for key in ("logprobs", "entropy"):
        got = _joined(two_ranks, name, key, sp)
        torch.testing.assert_close(got, ref[key], atol=2e-5, rtol=1e-4, msg=f"{name}: {key}")
    for rank in two_ranks:
        assert rank[name]["steps"][0]["grad_norm"] == pytest.approx(ref["steps"][0]["grad_norm"], rel=1e-4)
        assert rank[name]["steps"][0]["num_tokens"] == ref["steps"][0]["num_tokens"]
    # rank 0 exports full weights; the update is linear in the gradient (GRAD_PROBE_OPTIM)
    delta, want = two_ranks[0][name]["delta"], ref["delta"]
    assert delta.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(delta[k], want[k], atol=2e-7, rtol=2e-3, msg=f"{name}: gradient of {k}")
    assert any(float(want[k].abs().max()) > 1e-6 for k in want), "the probe saw no gradient"


def test_non_zero_ranks_export_nothing(two_ranks: list[dict[str, Any]]) -> None:
    assert two_ranks[1]["dp2_packed"]["delta"] == {}


@pytest.mark.parametrize("name", ["dp2_packed", "sp2_padded"])
def test_each_rank_exports_its_own_rows_and_they_rebuild_the_weights(name: str, two_ranks: list[dict[str, Any]]) -> None:
    """param_server.collective_sharded: every rank sends only what it owns (no all-gather); the
    receivers' assembler rebuilds exactly what rank 0's full export gives."""
    from services.weights.shards import ShardAssembler, parse_shard

    want = two_ranks[0][name]["final"]
    shards = [two_ranks[r][name]["shards"] for r in (0, 1)]
    assert shards[0] and shards[1]
    for own in shards:  # each rank sends about half of the bytes
        sent = sum(t.numel() * t.element_size() for _, t in own)
        assert sent < 0.75 * sum(t.numel() * t.element_size() for t in want.values())
        assert all(parse_shard(n) is not None for n, _ in own)  # every parameter of >= 2 rows is split
    asm = ShardAssembler("cpu")
    got = dict(x for own in shards for n, t in own for x in asm.add(n, t))
    assert asm.finish() == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_scenarios_do_split_the_work(two_ranks: list[dict[str, Any]], tmp_path: Path) -> None:
    dp = two_ranks[0]["dp2_packed"]["index"], two_ranks[1]["dp2_packed"]["index"]
    assert sorted(dp[0] + dp[1]) == [0, 1, 2, 3] and dp[0] and dp[1]
    uneven = two_ranks[0]["dp2_padded_uneven"]["index"], two_ranks[1]["dp2_padded_uneven"]["index"]
    assert sorted(len(u) for u in uneven) == [1, 2]  # one rank runs a zero-weight dummy micro-batch
    assert two_ranks[0]["sp2_packed"]["index"] == two_ranks[1]["sp2_packed"]["index"] == [0, 1, 2, 3]


def test_one_rank_checkpoint_resumes_on_two_ranks(two_ranks: list[dict[str, Any]], one_rank_checkpoint: Path) -> None:
    """One rank trains unsharded; its checkpoint loads into two sharded ranks, which then give the
    logprobs and the AdamW update that the one rank gives after resuming."""
    engine = build(make_spec(**RESUME))
    engine.load_checkpoint(one_rank_checkpoint)
    ref = run_scenario(engine, fixed_batch())
    engine.close()
    fresh = build(make_spec(**RESUME))
    untrained = run_scenario(fresh, fixed_batch())
    fresh.close()
    no_moments = build(make_spec(**RESUME))
    no_moments.load_checkpoint(one_rank_checkpoint)
    no_moments.optimizer.state.clear()  # type: ignore[attr-defined]
    without = run_scenario(no_moments, fixed_batch())["delta"]
    no_moments.close()
    got = _joined(two_ranks, "resume_dp2", "logprobs", 1)
    torch.testing.assert_close(got, ref["logprobs"], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(got, untrained["logprobs"], atol=1e-3), "the checkpoint's weights were not loaded"
    for rank in two_ranks:
        assert rank["resume_dp2"]["steps"][0]["grad_norm"] == pytest.approx(ref["steps"][0]["grad_norm"], rel=1e-4)
    delta, want = two_ranks[0]["resume_dp2"]["delta"], ref["delta"]
    for k in want:  # the update uses the restored AdamW moments...
        torch.testing.assert_close(delta[k], want[k], atol=1e-6, rtol=1e-3, msg=f"update of {k}")
    # ...which matter: without them the same step moves the weights differently
    assert any(not torch.allclose(without[k], want[k], atol=1e-5) for k in want)
