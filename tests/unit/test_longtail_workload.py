"""The long-tailed copy workload (data.synthetic.length_tail_alpha / max_digits), its warm start's
cache key, the qwen3_small tiny size, and the pure parts of `meshrl bench e2e` (phases, ratios,
merging, GPU utilization from an nvidia-smi CSV)."""

from __future__ import annotations

import random
from datetime import datetime
from pathlib import Path

import pytest

from meshrl.bench.e2e import gpu_utilization, merge_results, mesh_phases, ratios
from meshrl.pretrain import PretrainSpec, checkpoint_path
from services.common.config import load_config
from services.common.data import synthetic_records, tail_length, train_dataset
from services.common.errors import ConfigError


def test_tail_lengths_are_heavy_tailed_and_capped() -> None:
    rng = random.Random(0)
    lengths = [tail_length(rng, 4, 1.5, 64) for _ in range(20_000)]
    assert min(lengths) == 4 and max(lengths) == 64
    n = len(lengths)
    # Pareto(1.5) from 4: P(len >= 8) = 2^-1.5 = 0.354, P(len >= 32) = 8^-1.5 = 0.044.
    assert abs(sum(x >= 8 for x in lengths) / n - 0.354) < 0.02
    assert abs(sum(x >= 32 for x in lengths) / n - 0.044) < 0.008
    # Most prompts are short, the longest are 16x the shortest: the median is far below the mean of the top 1%.
    lengths.sort()
    median, top = lengths[n // 2], lengths[-n // 100 :]
    assert median <= 6 and sum(top) / len(top) > 8 * median


def test_copy_records_follow_the_tail_and_answers_match() -> None:
    recs = synthetic_records("copy", 2000, digits=4, seed=0, split="train", length_tail_alpha=1.5, max_digits=64)
    lens = [len(r.ground_truth) for r in recs.records]
    assert min(lens) == 4 and 32 <= max(lens) <= 64
    for r in recs.records[:50]:
        assert r.text == f"copy {r.ground_truth}:" and r.ground_truth.isdigit()
    # Deterministic per (seed, split); train and val differ.
    again = synthetic_records("copy", 2000, digits=4, seed=0, split="train", length_tail_alpha=1.5, max_digits=64)
    assert [r.text for r in again.records] == [r.text for r in recs.records]
    val = synthetic_records("copy", 50, digits=4, seed=0, split="val", length_tail_alpha=1.5, max_digits=64)
    assert [r.text for r in val.records] != [r.text for r in recs.records[:50]]


def test_without_a_tail_the_records_are_unchanged() -> None:
    """The built-in example's prompts do not move (same RNG draws as before the tail existed)."""
    recs = synthetic_records("copy", 5, digits=4, seed=0, split="train")
    assert {len(r.ground_truth) for r in recs.records} == {4}
    rng = random.Random("copy:train:0")
    assert recs.records[0].ground_truth == "".join(rng.choice("0123456789") for _ in range(4))


def test_config_fields_reach_the_dataset_and_bad_values_name_the_field() -> None:
    cfg = load_config(None, ["data.synthetic.name=copy", "data.synthetic.digits=3",
                             "data.synthetic.length_tail_alpha=1.2", "data.synthetic.max_digits=40",
                             "data.synthetic.num_train=500"])
    lens = [len(r.ground_truth) for r in train_dataset(cfg.data).records]
    assert min(lens) == 3 and max(lens) <= 40 and max(lens) > 12
    with pytest.raises(ValueError, match="length_tail_alpha applies to the copy task only"):
        load_config(None, ["data.synthetic.name=addition", "data.synthetic.length_tail_alpha=1.5"])
    with pytest.raises(ValueError, match="max_digits=2 is below digits=4"):
        load_config(None, ["data.synthetic.name=copy", "data.synthetic.digits=4", "data.synthetic.max_digits=2"])
    with pytest.raises(ConfigError, match="copy task only"):
        synthetic_records("addition", 3, digits=2, seed=0, split="train", length_tail_alpha=1.5)


def test_pretrain_key_names_the_warm_start_and_the_tail_gets_its_own() -> None:
    base = PretrainSpec()
    # The example trains to a loss now: a checkpoint cached by the old fixed 500 steps is not reused.
    old500 = PretrainSpec(steps=500, stop_loss=None)
    assert base.key() != old500.key() and base.stop_loss is not None
    import hashlib
    import json
    from dataclasses import asdict

    # Fields added later are left out while unset, so checkpoints made before them keep their names.
    later = ("length_tail_alpha", "max_digits", "warmup_steps", "stop_loss", "tool_fraction", "stop_loss_on")
    old = {k: v for k, v in asdict(old500).items() if k not in later}
    assert old500.key() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:12]
    tail = PretrainSpec(task="copy", digits=4, length_tail_alpha=1.5, max_digits=64)
    assert tail.key() != PretrainSpec(task="copy", digits=4).key()
    assert "copy4tail" in checkpoint_path(tail).name
    assert PretrainSpec(arch="qwen3_small").key() != base.key()


def test_qwen3_small_is_a_qwen3_of_about_25m_parameters() -> None:
    from services.common.tiny import build_tokenizer, tiny_config

    cfg = tiny_config("qwen3_small", len(build_tokenizer()))
    assert cfg.model_type == "qwen3" and cfg.hidden_size == 512 and cfg.num_hidden_layers == 8
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    attn = h * cfg.num_attention_heads * cfg.head_dim * 2 + h * cfg.num_key_value_heads * cfg.head_dim * 2
    assert 20e6 < layers * (attn + 3 * h * i) < 30e6


def _step(t: float, **timing: float) -> dict[str, float]:
    return {"time": t, "critic/rewards/mean": 0.0, **{f"timing_s/{k}": v for k, v in timing.items()}}


def test_mesh_phases_split_the_trainer_step_and_the_rollout_window() -> None:
    steps = [_step(10.0, step=2.0, update_actor=0.5, old_logprob=0.25, publish=0.25, wait_data=1.0),
             _step(12.0, step=2.0, update_actor=0.5, old_logprob=0.25, publish=0.25, wait_data=0.5)]
    rollout = [
        {"time": 7.0, "rollout/interval_s": 1.0, "rollout/busy_s": 1.0, "rollout/tokens_per_s": 5.0},  # before
        {"time": 9.0, "rollout/interval_s": 1.0, "rollout/busy_s": 0.25, "rollout/tokens_per_s": 100.0},
        {"time": 11.0, "rollout/interval_s": 2.0, "rollout/busy_s": 1.75, "rollout/tokens_per_s": 400.0},
        {"time": 11.5, "rollout/idle_ratio": 0.0},  # an older record without the fields: skipped
    ]
    p = mesh_phases(steps, rollout, start=8.0, end=12.0)
    assert p["training"] == 1.5 and p["weight_sync"] == 0.5 and p["trainer_idle"] == 1.5
    assert p["trainer_other"] == 0.5
    assert p["generation"] == 2.0 and p["rollout_idle"] == 1.0 and p["rollout_busy_fraction"] == 0.667
    assert p["rollout_tokens_per_s"] == 300.0


def _case(steps: int, per_step: float, ttt: dict[str, float | None], start: float = 0.0) -> dict[str, object]:
    first = next(iter(ttt.values()))
    return {"steps": steps, "per_step_s": per_step, "train_loop_s": steps * per_step, "time_to_target_s": first,
            "time_to_targets_s": ttt, "loop_start_unix": start, "loop_end_unix": start + steps * per_step}


def test_ratios_compare_sync_to_async_per_target_and_per_step() -> None:
    cases = {"fully_async": _case(100, 0.5, {"0.6": 10.0, "0.8": 30.0}),
             "sync": _case(40, 1.5, {"0.6": 25.0, "0.8": None}),
             "plain": _case(40, 1.0, {"0.6": 20.0, "0.8": 50.0})}
    r = ratios(cases)
    assert r["sync_over_async_time_to_target"] == 2.5 and r["sync_over_async_per_step"] == 3.0
    assert r["sync_over_async_time_to_targets"] == {"0.6": 2.5, "0.8": None}
    assert "sync_over_async_train_loop" not in r  # different step counts: loop times are not comparable
    assert r["sync_over_plain_train_loop"] == 1.5 and r["fully_async_over_plain_time_to_target"] == 0.5


def test_merge_results_combines_separate_invocations_with_gpu_utilization(tmp_path: Path) -> None:
    t0 = datetime(2026, 11, 26, 12, 0, 0).timestamp()
    csv_path = tmp_path / "gpu.csv"
    rows = []
    for s in range(20):
        ts = datetime.fromtimestamp(t0 + s).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        rows.append(f"{ts}, 0, {90 if s < 10 else 10}, {1000 + s}")
        rows.append(f"{ts}, 1, {20 if s < 10 else 70}, 500")
    csv_path.write_text("garbage line\n" + "\n".join(rows) + "\n")
    a = {"benchmark": "e2e", "cases": {"fully_async": _case(10, 1.0, {"0.6": 5.0}, start=t0)}, "ratios": {}}
    b = {"benchmark": "e2e", "cases": {"sync": _case(5, 2.0, {"0.6": 9.0}, start=t0 + 10)}, "ratios": {}}
    m = merge_results([a, b], gpu_csv=csv_path)
    assert set(m["cases"]) == {"fully_async", "sync"}
    assert m["ratios"]["sync_over_async_time_to_target"] == 1.8
    ga, gs = m["cases"]["fully_async"]["gpu_utilization"], m["cases"]["sync"]["gpu_utilization"]
    assert ga["0"]["util_mean_pct"] > 80 and ga["1"]["util_mean_pct"] < 30  # samples 0..10 s
    assert gs["0"]["util_mean_pct"] < 20 and gs["1"]["util_mean_pct"] > 60 and gs["0"]["mem_max_mib"] == 1019
    assert gpu_utilization(csv_path, t0 + 100, t0 + 200) == {}
    with pytest.raises(ValueError, match="nothing to merge"):
        merge_results([])


def test_wire_moves_the_param_server_off_a_port_another_run_holds() -> None:
    """gRPC servers bind with SO_REUSEPORT: a second run on the default port would share it and its
    rollouts would fetch another run's weights (seen on the shared sandbox)."""
    import socket

    from meshrl.train import wire

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = wire(load_config(None, [f"param_server.port={port}"]), 9000)
        assert cfg.param_server.port not in (port, 0)
    # The default port is never used as is on loopback; a port the user set and that is free is kept.
    default = wire(load_config(None, []), 9000).param_server.port
    assert default > 0
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        mine = probe.getsockname()[1]
    assert wire(load_config(None, [f"param_server.port={mine}"]), 9000).param_server.port == mine


def test_sft_stops_at_the_loss_threshold_and_records_it(tmp_path: Path) -> None:
    import json

    from meshrl.pretrain import train_sft

    spec = PretrainSpec(task="copy", digits=2, length_tail_alpha=1.5, max_digits=8, steps=200, batch_size=4,
                        num_examples=64, stop_loss=100.0)
    metrics = train_sft(spec, tmp_path / "ckpt")
    assert metrics["steps"] == 50  # the first moment 50 losses exist, their mean is below 100
    saved = json.loads((tmp_path / "ckpt" / "meshrl_pretrain.json").read_text())
    assert saved["spec"]["stop_loss"] == 100.0 and saved["metrics"]["steps"] == 50


def test_tool_add_stops_on_its_tool_traces_loss(tmp_path: Path) -> None:
    """tool_add's warm start reads the tool traces' loss alone (meshrl/pretrain.py, TASK_DEFAULTS):
    their tokens copy a template and the operands, so it sits far below the mixed loss, which the
    head answers' three-digit sums keep high."""
    import json

    from meshrl.pretrain import TASK_DEFAULTS, train_sft

    assert PretrainSpec.for_task("tool_add", digits=3).stop_loss_on == "tool" == TASK_DEFAULTS["tool_add"]["stop_loss_on"]
    runs = {}
    for on in (None, "tool"):
        small = PretrainSpec(task="tool_add", digits=3, steps=60, batch_size=16, num_examples=256, stop_loss=100.0,
                             stop_loss_on=on)
        runs[on] = train_sft(small, tmp_path / f"ckpt-{on}")
        assert runs[on]["steps"] == 50
        saved = json.loads((tmp_path / f"ckpt-{on}" / "meshrl_pretrain.json").read_text())
        assert saved["spec"]["stop_loss_on"] == on
    # the same 50 steps (same seed and batches): the tool traces' mean loss alone is below the mix's
    assert runs["tool"]["mean_loss_last_50"] < runs[None]["mean_loss_last_50"]
    with pytest.raises(ValueError, match="stop_loss_on='tool': null, or 'tool' with task tool_add"):
        train_sft(PretrainSpec(task="addition", stop_loss_on="tool"), tmp_path / "bad")
