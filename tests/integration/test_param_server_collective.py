"""The collective transport with the gloo backend: two real processes (trainer rank 0 and one
rollout rank) meeting through a real param server over gRPC. The same code path runs nccl on the
GPU machine (tests/gpu/test_param_server_nccl.py) and hccl on Ascend."""

from __future__ import annotations

import pytest

from services.common.errors import MissingDependency

from .collective_workers import (
    check_a_broadcast_a_peer_broke_off_is_sent_again,
    check_a_param_server_away,
    check_a_replacement_takes_a_dead_receivers_place,
    check_delta_sync,
    check_nacks_and_abort,
    check_receiver_behind_gives_up_and_the_sender_moves,
    check_sender_moves_to_a_new_generation,
    check_steady_group_version_mismatch,
    check_the_only_receiver_replaced_after_a_version_gets_it_again,
    run_pair,
)


def test_gloo_broadcast_round_trip_corruption_stuck_peer_and_recovery() -> None:
    got = run_pair(
        "gloo",
        sender_plan=[(1, "ok"), (2, "ok"), (3, "hang"), (4, "ok"), (5, "announce")],
        receiver_plan=[(1, "ok", 60.0), (2, "corrupt", 60.0), (3, "ok", 3.0), (4, "ok", 60.0), (5, "announced", 60.0)],
    )
    # bytes identical, dtypes kept (bf16, fp32, bool)
    assert got[("recv", 1)] == ("identical", 0)
    assert len(got[("sent", 1)][0]) == 64
    # a bucket damaged on the receiver is NACKed and sent again
    assert got[("recv", 2)] == ("identical", 1) and got[("sent", 2)][1] == 1
    # the sender stalls: the receiver gives up with DEADLINE_EXCEEDED, the sender fails too
    assert got[("recv", 3)][0].startswith("DeadlineExceeded") and "stuck" in got[("recv", 3)][0]
    assert got[("sent", 3)][0].startswith("DeadlineExceeded")
    # and the group re-forms (new generation) for the next version
    assert got[("recv", 4)][0] == "identical" and len(got[("sent", 4)][0]) == 64
    # announce first (the trainer's CommitVersion), then broadcast; publish returns that same ref
    assert got[("recv", 5)][0] == "identical" and got[("sent", 5)][0] == "announced ref", got
    assert got["versions"] == [4, 5]  # 3 never completed; retention keeps the newest 2


def test_gloo_two_receivers_get_every_version_and_one_receivers_nack_resends_to_both() -> None:
    got = run_pair(
        "gloo",
        sender_plan=[(1, "ok"), (2, "ok"), (3, "split"), (4, "ok")],
        receiver_plan=[(1, "ok", 60.0), (2, "corrupt", 60.0), (3, "ok", 60.0), (4, "corrupt_meta", 60.0)],
        more_receivers=([(1, "ok", 60.0), (2, "ok", 60.0), (3, "ok", 60.0), (4, "ok", 60.0)],),
    )
    for version in (1, 2, 3, 4):
        assert got[("recv", version)][0] == "identical", got
        assert got[("recv1", version)][0] == "identical", got
    # the damaged receiver NACKed once (the nacks of all receivers are summed); the sender sent the
    # bucket again to the group, and the other receiver, which had it right, kept its first copy
    assert got[("recv", 2)][1] == 1 and got[("recv1", 2)][1] == 0, got
    assert got[("sent", 2)][1] == 1 and got[("sent", 3)][1] == 1, got  # resent_buckets is cumulative
    # a flipped bit in a bucket's metadata (names, shapes, offsets: not under the fingerprint
    # columns) is NACKed and resent like one in its bytes, before anything is handed on
    assert got[("recv", 4)][1] == 2 and got[("sent", 4)][1] == 2, got
    assert got["versions"] == [3, 4]  # version 3 went out in 4 wire buckets (the first split in two)


def test_gloo_nacks_mid_stream_and_on_the_last_bucket_and_gives_up_after_max_attempts() -> None:
    check_nacks_and_abort("gloo")


def test_gloo_a_receiver_ahead_fails_the_senders_version_at_once_and_gets_its_own_in_a_new_group() -> None:
    check_steady_group_version_mismatch("gloo")


def test_gloo_the_sender_moves_a_version_to_the_generation_a_failed_receiver_joined() -> None:
    check_sender_moves_to_a_new_generation("gloo")


def test_gloo_a_receiver_behind_gives_its_version_up_and_the_sender_moves_to_where_it_checks_in() -> None:
    check_receiver_behind_gives_up_and_the_sender_moves("gloo")


def test_gloo_a_replacement_takes_the_place_of_a_receiver_that_died_and_the_sender_goes_on() -> None:
    check_a_replacement_takes_a_dead_receivers_place("gloo")


@pytest.mark.parametrize("case", ["dies", "stalls"])
def test_gloo_a_broadcast_a_receiver_broke_off_is_sent_again_to_the_live_ones_and_the_replacement(case: str) -> None:
    check_a_broadcast_a_peer_broke_off_is_sent_again("gloo", case)


def test_gloo_the_only_receiver_replaced_right_after_a_version_gets_that_version_sent_again() -> None:
    check_the_only_receiver_replaced_after_a_version_gets_it_again("gloo")


def test_gloo_a_param_server_late_or_replaced_is_waited_for_and_every_version_arrives() -> None:
    check_a_param_server_away("gloo")


def test_hccl_fails_fast_without_torch_npu() -> None:
    pytest.importorskip("torch")
    try:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch_npu is installed")
    from services.weights.transports.collective import CollectiveFetcher, CollectivePublisher

    with pytest.raises(MissingDependency, match="torch_npu"):
        CollectivePublisher("hccl", "127.0.0.1:1", receivers=1)
    with pytest.raises(MissingDependency, match="CANN"):
        CollectiveFetcher("hccl", "127.0.0.1:1", consumer_id="r")



def test_gloo_delta_sync_sends_changed_elements_and_goes_whole_after_a_receiver_drifts() -> None:
    check_delta_sync("gloo", receivers=2)
