"""The trainer's Prometheus families (services/common/metrics.py), from the loop's status: the
last step's numbers as gauges, steps and tokens as counters."""

from __future__ import annotations

from meshrl.v1 import trainer_pb2
from services.common.metrics import Family, ReplicaMetrics

FAMILIES = (
    Family("meshrl_trainer_steps", "Optimizer steps (local steps) done.", "counter"),
    Family("meshrl_trainer_tokens_trained", "Tokens trained on (x ppo_epochs).", "counter"),
    Family("meshrl_trainer_step", "The local step the trainer has finished."),
    Family("meshrl_trainer_policy_version", "Policy version of the trainer's weights."),
    Family("meshrl_trainer_step_seconds", "Seconds of the last step (fetch to publish)."),
    Family("meshrl_trainer_idle_ratio", "Share of the last step spent waiting for data."),
    Family("meshrl_trainer_tokens_per_s", "Tokens per second of the last step's training."),
    Family("meshrl_trainer_loss", "Policy loss of the last step (actor/pg_loss)."),
    Family("meshrl_trainer_grad_norm", "Gradient norm of the last step."),
    Family("meshrl_trainer_reward_mean", "Mean reward of the last step's groups."),
    Family("meshrl_trainer_staleness_mean", "Mean staleness of the last step's groups (versions)."),
    Family("meshrl_trainer_publish_seconds", "Seconds the last weight publish took on the trainer."),
)

GAUGES = {
    "meshrl_trainer_step_seconds": "timing_s/step",
    "meshrl_trainer_idle_ratio": "perf/idle_ratio",
    "meshrl_trainer_tokens_per_s": "perf/throughput_tokens_per_s",
    "meshrl_trainer_loss": "actor/pg_loss",
    "meshrl_trainer_grad_norm": "actor/grad_norm",
    "meshrl_trainer_reward_mean": "critic/rewards/mean",
    "meshrl_trainer_staleness_mean": "staleness/mean",
    "meshrl_trainer_publish_seconds": "timing_s/publish",
}


def export(m: ReplicaMetrics, status: trainer_pb2.GetTrainerStatusResponse) -> None:
    m.count_to("meshrl_trainer_steps", status.step)
    m.count_to("meshrl_trainer_tokens_trained", status.tokens_trained)
    m.set("meshrl_trainer_step", status.step)
    m.set("meshrl_trainer_policy_version", status.policy_version)
    for family, key in GAUGES.items():
        value = status.metrics.get(key)
        if value is not None and value == value:  # NaN: a step without the number
            m.set(family, value)
