"""The collective transport over NCCL: trainer rank 0 on GPU 0, a rollout rank on GPU 1, the
group formed through a real param server. Needs 2 CUDA devices (NCCL refuses two ranks on one
device). Run by scripts/gpu/weights.sh."""

from __future__ import annotations

import pytest
import torch

from tests.integration.collective_workers import (
    check_delta_sync,
    check_nacks_and_abort,
    check_receiver_behind_gives_up_and_the_sender_moves,
    check_sender_moves_to_a_new_generation,
    check_steady_group_version_mismatch,
    run_pair,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA devices (NCCL cannot put two ranks on one GPU)"),
]


def test_nccl_broadcast_round_trip_corruption_stuck_peer_and_recovery() -> None:
    got = run_pair(
        "nccl",
        sender_plan=[(1, "ok"), (2, "ok"), (3, "hang"), (4, "ok"), (5, "announce")],
        receiver_plan=[(1, "ok", 120.0), (2, "corrupt", 120.0), (3, "ok", 3.0), (4, "ok", 120.0), (5, "announced", 120.0)],
        deadline_s=420.0,
    )
    assert got[("recv", 1)] == ("identical", 0), got  # bytes identical, bf16/fp32/bool kept, on GPU
    assert got[("recv", 2)] == ("identical", 1) and got[("sent", 2)][1] == 1, got  # NACK + resend
    assert got[("recv", 3)][0].startswith("DeadlineExceeded"), got  # stuck sender: no hang
    assert got[("sent", 3)][0].startswith("DeadlineExceeded"), got
    assert got[("recv", 4)][0] == "identical", got  # the group re-formed (new generation)
    # announce first (the trainer's CommitVersion), then broadcast; publish returns that same ref
    assert got[("recv", 5)][0] == "identical" and got[("sent", 5)][0] == "announced ref", got
    assert got["versions"] == [4, 5], got


def test_nccl_nacks_mid_stream_and_on_the_last_bucket_and_gives_up_after_max_attempts() -> None:
    check_nacks_and_abort("nccl", deadline_s=420.0)


def test_nccl_a_receiver_ahead_fails_the_senders_version_at_once_and_gets_its_own_in_a_new_group() -> None:
    check_steady_group_version_mismatch("nccl", deadline_s=420.0)


def test_nccl_the_sender_moves_a_version_to_the_generation_a_failed_receiver_joined() -> None:
    check_sender_moves_to_a_new_generation("nccl", deadline_s=420.0)


def test_nccl_a_receiver_behind_gives_its_version_up_and_the_sender_moves_to_where_it_checks_in() -> None:
    check_receiver_behind_gives_up_and_the_sender_moves("nccl", deadline_s=420.0)


def test_nccl_delta_sync_sends_changed_elements_and_goes_whole_after_a_receiver_drifts() -> None:
    check_delta_sync("nccl", receivers=1, deadline_s=420.0)
