"""Helpers to drive a CoordinatorCore in unit tests."""

from __future__ import annotations

from pathlib import Path

from meshrl.v1 import common_pb2
from services.common.data import PromptStream, synthetic_records
from services.coordinator.core import CoordinatorCore, CoordinatorSettings, GroupIn
from services.coordinator.ledger import Ledger


def make_core(
    path: Path | str,
    *,
    mini_batch: int = 4,
    staleness: float = 0.5,
    trigger: int = 1,
    total: int = 40,
    lease_timeout_s: float = 10.0,
    eta: int | None = None,
    dataset_size: int = 16,
    session: str = "s1",
    ledger: Ledger | None = None,
    keep_delivered_payloads: bool = True,
    max_prompt_failures: int | None = None,
    max_consecutive_failures: int | None = None,
) -> CoordinatorCore:
    settings = CoordinatorSettings(
        required_samples=mini_batch,
        staleness_threshold=staleness,
        trigger_parameter_sync_step=trigger,
        prompts_total=total,
        session=session,
        lease_timeout_s=lease_timeout_s,
        max_staleness_versions=eta,
        keep_delivered_payloads=keep_delivered_payloads,
        max_prompt_failures=max_prompt_failures,
        max_consecutive_failures=max_consecutive_failures,
    )
    stream = PromptStream(synthetic_records("addition", dataset_size, digits=2, seed=0, split="train"), shuffle=True, seed=3)
    return CoordinatorCore(settings, stream, ledger if ledger is not None else Ledger(path))


def group_for(lease_id: str, seq: int, version: int, n: int = 2, tokens: int = 3) -> GroupIn:
    g = common_pb2.TrajectoryGroup(lease_id=lease_id, min_policy_version=version, max_policy_version=version)
    g.prompt.prompt_seq = seq
    for i in range(n):
        g.responses.add(sample_index=i, token_ids=[1] * tokens, logprobs=[-0.5] * tokens, versions=[version] * tokens)
    return GroupIn(lease_id, seq, version, version, g.SerializeToString())
