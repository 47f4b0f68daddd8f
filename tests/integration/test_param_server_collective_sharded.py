"""Weight sync from every trainer rank over gloo: two trainer ranks each broadcast the rows they
own (uneven FSDP-style splits, a tensor only one rank owns, one nobody shards) to two rollout
ranks, which rebuild whole tensors; real processes, a real param server over gRPC. The same code
runs nccl on the GPU machine (meshrl/bench/weights_sharded.py)."""

from __future__ import annotations

import time

from .sharded_workers import run_sharded


def test_gloo_two_trainer_ranks_to_two_rollout_ranks_checksums_nack_stuck_rank_and_recovery() -> None:
    got = run_sharded(
        "gloo", 2,
        sender_plans=[[(1, "ok"), (2, "ok"), (3, "ok"), (4, "ok")], [(1, "ok"), (2, "ok"), (3, "hang"), (4, "ok")]],
        receiver_plans=[[(1, "ok", 60.0), (2, "corrupt", 60.0), (3, "ok", 3.0), (4, "ok", 150.0)],
                        [(1, "ok", 60.0), (2, "ok", 60.0), (3, "ok", 3.0), (4, "ok", 150.0)]],
    )
    # every rollout rank gets every byte of every tensor, dtypes kept, from both trainer ranks
    assert got[("recv0", 1)] == ("identical", 0) and got[("recv1", 1)] == ("identical", 0), got
    assert got[("sent0", 1)] == ("ok", 0) and got[("sent1", 1)] == ("ok", 0), got
    # a bucket from trainer rank 1 damaged on rollout rank 0: NACKed, rank 1 sends it again
    assert got[("recv0", 2)] == ("identical", 1) and got[("recv1", 2)] == ("identical", 0), got
    assert got[("sent1", 2)][1] == 1 and got[("sent0", 2)][1] == 0, got
    # trainer rank 1 stalls: both rollout ranks give up with DEADLINE_EXCEEDED (rank 0's part alone is
    # not a version), rank 1 fails too when it wakes: its deadline passed, or the param server tells it
    # that its receivers moved on to version 4 (its rendezvous RPC may have left before it stalled)
    for role in ("recv0", "recv1"):
        assert got[(role, 3)][0].startswith("DeadlineExceeded"), got
    sent1_v3 = got[("sent1", 3)][0]
    assert sent1_v3.startswith("DeadlineExceeded") or (
        sent1_v3.startswith("FailedPrecondition") and "asked for a newer version only" in sent1_v3), got
    assert got["versions"] == []  # no sender holds the whole manifest: none is registered
    # and the groups re-form for the next version, on every side (issue 21: the receivers reported the
    # generation they failed in, so trainer rank 1's group re-forms in a new one; trainer rank 0's
    # healthy group was not frozen by the release of the stuck one)
    assert got[("recv0", 4)] == ("identical", 1) and got[("recv1", 4)] == ("identical", 0), got
    assert got[("sent0", 4)][0] == "ok" and got[("sent1", 4)][0] == "ok", got


def test_gloo_delta_sync_from_every_trainer_rank_rebuilds_whole_tensors() -> None:
    """Delta sync with weight sync from every rank: each trainer rank keeps a copy of the rows it
    sent, each rollout rank one per trainer rank, so each rank's rows go as deltas against the
    base its own group agreed on, and the rollout ranks rebuild whole tensors bit for bit."""
    plan = [(v, "delta") for v in range(1, 4)]
    got = run_sharded("gloo", 2, sender_plans=[plan, plan],
                      receiver_plans=[[(v, "delta", 60.0) for v in range(1, 4)] for _ in range(2)])
    for version in range(1, 4):
        for role in ("recv0", "recv1"):
            assert got[(role, version)][0] == "identical", got
        for role in ("sent0", "sent1"):  # the first version whole, then each against the one before
            # down_proj's rows (200 KB per rank) go as a delta; the smaller tensors whole
            assert got[(role, version)][0] == f"ok base={version - 1} deltas={int(version > 1)}", got


def test_gloo_megatron_layout_columns_and_a_replica_that_sends_nothing() -> None:
    """megatron's layout (param_server.collective_sharded with the megatron engine): two TP ranks
    own the tensors, one row-parallel weight split by columns, and a third trainer rank is a
    data-parallel replica whose stream is empty. The rollout ranks still rebuild every tensor,
    version after version, and the replica's sender finishes each version like the others."""
    plan = [(v, "megatron") for v in range(1, 3)]
    got = run_sharded("gloo", 3, sender_plans=[plan, plan, plan],
                      receiver_plans=[[(v, "megatron", 60.0) for v in range(1, 3)] for _ in range(2)])
    for version in range(1, 3):
        for role in ("recv0", "recv1"):
            assert got[(role, version)] == ("identical", 0), got
        for role in ("sent0", "sent1", "sent2"):
            assert got[(role, version)] == ("ok", 0), got


def test_gloo_delta_sync_with_a_replica_that_sends_nothing() -> None:
    """Delta sync with megatron's layout: the data-parallel replica's version has no bucket, so
    its encoder never named the base; every rollout rank's part for it failed its commit
    (DataLoss: "no '#delta.base' entry"), hence every sharded version."""
    plan = [(v, "megatron_delta") for v in range(1, 3)]
    got = run_sharded("gloo", 3, sender_plans=[plan, plan, plan],
                      receiver_plans=[[(v, "megatron_delta", 60.0) for v in range(1, 3)] for _ in range(2)])
    for version in range(1, 3):
        for role in ("recv0", "recv1"):
            assert got[(role, version)][0] == "identical", got


def test_gloo_the_only_rollout_rank_replaced_right_after_a_version_gets_it_again_from_every_trainer_rank() -> None:
    """One rollout rank gets version 2 from both trainer ranks and dies (a single rollout replica
    killed right after loading it, while the trainer has no groups to train a next version on).
    Its replacement takes the silent member's place in each trainer rank's group (3 s here) and
    asks for version 2; the probe says every group waits for it, each trainer rank sends its rows
    again, and the replacement rebuilds whole tensors; version 3 follows."""
    t0 = time.monotonic()
    got = run_sharded(
        "gloo", 2,
        sender_plans=[[(1, "ok"), (2, "ok"), (2, "standby"), (3, "ok")] for _ in range(2)],
        receiver_plans=[[(1, "ok", 60.0), (2, "ok", 60.0), (3, "die", 60.0)],
                        [(2, "replacement", 60.0), (3, "ok", 60.0)]],
        sender_timeout_s=60.0, group_receivers=1, stall_timeout_s=3.0,
    )
    assert got[("recv0", 1)][0] == got[("recv0", 2)][0] == "identical" and got[("recv0", 3)][0] == "died", got
    assert got[("recv1", 2)][0] == got[("recv1", 3)][0] == "identical", got
    for role in ("sent0", "sent1"):
        assert got[(role, 1)][0] == got[(role, 2)][0] == got[(role, 2, "again")][0] == got[(role, 3)][0] == "ok", got
    assert time.monotonic() - t0 < 60, "the replacement waited for a deadline"
