"""Metrics as their names promise: critic/rewards is the KL-penalized reward (verl), the report's
optimizer steps are the JSONL's, and a resumed run keeps one step axis and one clock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshrl.trackers import MetricsFollower


class _Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log(self, data: Any, step: int) -> None:
        self.logged.append((dict(data), step))


def _append(path: Path, *recs: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def test_resumed_follower_logs_rollout_samples_at_the_last_trainer_step(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    # the first session: 5 trainer steps
    _append(metrics / "trainer.jsonl", *({"step": s, "time": 100.0 + s, "critic/rewards/mean": 0.1 * s} for s in range(1, 6)))
    rec = _Recorder()
    follower = MetricsFollower(tmp_path, rec, from_end=True)  # type: ignore[arg-type]
    # the resumed session: a rollout sample and a validation before its first trainer step
    _append(metrics / "rollout.jsonl", {"time": 200.0, "rollout/idle_ratio": 0.5})
    _append(metrics / "validation.jsonl", {"time": 201.0, "policy_version": 5, "val/score": 0.7})
    follower.pump()
    # they follow trainer step 5 (trackers such as wandb drop a step that goes back)
    assert [step for _, step in rec.logged] == [5, 5]


def _record_row(batch: Any, tmp_path: Path) -> dict[str, float]:
    """TrainerLoop._record on a stand-in loop: the step's metrics row."""
    from types import SimpleNamespace

    from services.trainer.core import TrainerLoop, _Collected
    from services.trainer.engines.base import StepResult

    fake = SimpleNamespace(
        s=SimpleNamespace(ppo_epochs=1, bypass_mode=True, metrics_path=None), tokens_trained=0, step=1,
        weights_version=0, group=SimpleNamespace(step=1), failed_broadcasts=0, last_metrics={},
    )
    got = _Collected(groups=[object()], staleness=[0], fetches=1)
    result = StepResult(grad_norm=1.0, lr=1e-3, metrics={"actor/pg_loss": 0.0}, num_tokens=1, step=1)
    TrainerLoop._record(fake, batch, got, [result], {}, wait_s=0.0, train_s=1.0, step_s=1.0)  # type: ignore[arg-type]
    return fake.last_metrics


def test_critic_rewards_mean_is_the_kl_penalized_reward_as_in_verl(tmp_path: Path) -> None:
    """verl: critic/score/* = token_level_scores summed per sequence, critic/rewards/* = token_level_rewards
    (scores minus the KL penalty when use_kl_in_reward) summed per sequence."""
    import torch

    from services.trainer.algos.advantages import KL_REWARD_KEY
    from services.trainer.engines.base import SequenceBatch

    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)
    batch = SequenceBatch(
        input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.long),
        response_mask=mask,
        tensors={"advantages": torch.zeros(2, 4), KL_REWARD_KEY: 0.1 * mask},  # penalty 0.2 and 0.3
        seq_tensors={"reward": torch.tensor([1.0, 0.0]), "response_length": torch.tensor([2.0, 3.0]),
                     "group_index": torch.tensor([0, 0])},
    )
    m = _record_row(batch, tmp_path)
    assert abs(m["critic/score/mean"] - 0.5) < 1e-6
    assert abs(m["critic/rewards/mean"] - (0.8 + -0.3) / 2) < 1e-6


def test_report_optimizer_steps_agree_with_the_trainer_jsonl(tmp_path: Path) -> None:
    """ppo_epochs=2: 3 trainer steps are 6 optimizer steps (training/optimizer_steps); the report's
    'optimizer steps' row must not show the trainer's step count."""
    from meshrl.report import load_run
    from meshrl.report_html import summary_rows

    metrics = tmp_path / "metrics"
    _append(metrics / "trainer.jsonl", *({"step": s, "time": 100.0 + s, "critic/rewards/mean": 0.5,
                                          "training/optimizer_steps": 2.0 * s} for s in range(1, 4)))
    (tmp_path / "summary.json").write_text(json.dumps({"mode": "fully_async", "steps": 3, "started_unix_s": 100.0}))
    rows = dict(summary_rows(load_run(tmp_path)))
    assert rows.get("optimizer steps") in (None, 6)
    assert rows.get("trainer steps") == 3


def test_report_wall_time_of_a_resumed_run_is_one_clock(tmp_path: Path) -> None:
    """A resumed run: summary.json is the last session's (started_unix_s = the resume), the metrics
    files hold both sessions. Wall time must not go negative nor restart for the second session."""
    from meshrl.report import load_run

    metrics = tmp_path / "metrics"
    _append(metrics / "trainer.jsonl", {"step": 1, "time": 110.0}, {"step": 2, "time": 120.0},
            {"step": 3, "time": 1010.0})
    # rollout samples carry the seconds since their own session started
    _append(metrics / "rollout.jsonl", {"time": 105.0, "time_s": 5.0, "rollout/idle_ratio": 0.1},
            {"time": 1005.0, "time_s": 5.0, "rollout/idle_ratio": 0.2})
    (tmp_path / "summary.json").write_text(json.dumps({"mode": "fully_async", "steps": 3, "started_unix_s": 1000.0}))
    run = load_run(tmp_path)
    trainer = [r["time_s"] for r in run.steps]
    rollout = [r["time_s"] for r in run.rollout]
    assert min(trainer + rollout) >= 0
    assert trainer == sorted(trainer) and rollout[0] < trainer[0] < trainer[1] < rollout[1] < trainer[2]


def test_response_length_has_verl_min_and_clip_ratio(tmp_path: Path) -> None:
    """verl's compute_data_metrics reports response_length/{mean,max,min,clip_ratio}; clip_ratio is
    the share of responses cut at the length limit (here: finish_reason LENGTH), the number that
    says max_response_length is too short."""
    import torch

    from meshrl.v1 import common_pb2
    from services.trainer.convert import groups_to_batch

    length, stop = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP
    group = common_pb2.TrajectoryGroup(lease_id="l0", prompt_token_ids=[1, 2], responses=[
        common_pb2.Response(token_ids=[3] * n, logprobs=[-0.5] * n, versions=[0] * n, finish_reason=f, reward=1.0)
        for n, f in ((4, length), (2, stop), (4, length), (1, stop))
    ])
    batch = groups_to_batch([group], pad_token_id=0)
    batch.tensors["advantages"] = torch.zeros_like(batch.response_mask)
    m = _record_row(batch, tmp_path)
    assert m["response_length/min"] == 1.0 and m["response_length/max"] == 4.0
    assert m["response_length/clip_ratio"] == 0.5


def test_fully_async_metrics_carry_verl_fully_async_names(tmp_path: Path) -> None:
    """verl's fully async trainer logs the share of a step spent waiting for samples as
    trainer/idle_ratio and the weight sync as timing_s/param_sync: the same numbers are there
    under those names (beside perf/idle_ratio and timing_s/publish, which the report reads)."""
    from types import SimpleNamespace

    import torch

    from services.trainer.core import TrainerLoop, _Collected
    from services.trainer.engines.base import SequenceBatch, StepResult

    batch = SequenceBatch(
        input_ids=torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 3, dtype=torch.long),
        response_mask=torch.tensor([[0.0, 1.0, 1.0]]), tensors={"advantages": torch.zeros(1, 3)},
        seq_tensors={"reward": torch.tensor([1.0]), "response_length": torch.tensor([2.0]),
                     "group_index": torch.tensor([0])},
    )
    fake = SimpleNamespace(
        s=SimpleNamespace(ppo_epochs=1, bypass_mode=True, metrics_path=None), tokens_trained=0, step=1,
        weights_version=1, group=SimpleNamespace(step=1), failed_broadcasts=0, last_metrics={},
    )
    result = StepResult(grad_norm=1.0, lr=1e-3, metrics={}, num_tokens=3, step=1)
    TrainerLoop._record(fake, batch, _Collected(groups=[object()], staleness=[1], fetches=1), [result],  # type: ignore[arg-type]
                        {"timing_s/publish": 0.75}, wait_s=0.5, train_s=1.5, step_s=2.0)
    m = fake.last_metrics
    assert m["trainer/idle_ratio"] == m["perf/idle_ratio"] == 0.25
    assert m["timing_s/param_sync"] == m["timing_s/publish"] == 0.75


def test_score_reward_advantage_and_prompt_length_carry_verl_max_min(tmp_path: Path) -> None:
    """verl's compute_data_metrics: critic/{score,rewards,advantages}/{mean,max,min} (advantages over
    the response tokens only) and prompt_length/{mean,max,min}."""
    import torch

    from meshrl.v1 import common_pb2
    from services.trainer.convert import groups_to_batch

    groups = [
        common_pb2.TrajectoryGroup(lease_id=f"l{i}", prompt_token_ids=[1] * p, responses=[
            common_pb2.Response(token_ids=[3] * n, logprobs=[-0.5] * n, versions=[0] * n, reward=r)
            for n, r in ((2, 1.0), (3, -1.0))
        ])
        for i, p in enumerate((2, 5))
    ]
    batch = groups_to_batch(groups, pad_token_id=0)
    # padding and prompt positions hold out-of-range advantages: they must not count
    batch.tensors["advantages"] = torch.where(batch.response_mask.bool(), 0.5, 9.0)
    batch.tensors["advantages"][1, 2] = -0.25
    batch.tensors["advantages"][1, 3] = -0.25
    m = _record_row(batch, tmp_path)
    assert (m["critic/score/max"], m["critic/score/min"]) == (1.0, -1.0)
    assert (m["critic/rewards/max"], m["critic/rewards/min"]) == (1.0, -1.0)
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == (0.5, -0.25)
    assert (m["prompt_length/mean"], m["prompt_length/max"], m["prompt_length/min"]) == (3.5, 5.0, 2.0)
