"""The driver's failure bookkeeping (meshrl/watchdog.py) with an injected clock: a failed trainer
gets `max_restarts` restarts by Serve within `restart_timeout_s`, then the run stops with the
cause; a coordinator outage is waited out within a bound; a halt on failures stops the run with
the coordinator's reason; summary.json gets the failure, the incidents and the resume command."""

from __future__ import annotations

import pytest

from meshrl.v1 import coordinator_pb2
from meshrl.watchdog import OUTAGE_LIMIT_S, RunFailure, Watchdog


def _trainer(state: str, replica: str, step: int = 7, error: str | None = None) -> dict[str, object]:
    return {"state": state, "replica": replica, "step": step, "error": error}


def test_a_failed_trainer_is_waited_for_once_then_the_run_stops_with_the_cause() -> None:
    w = Watchdog("runs/x", max_restarts=1, restart_timeout_s=100.0, started=0.0)
    assert w.trainer_state(1.0, _trainer("training", "a")) == "training"
    died = "ActorDiedError: The actor died unexpectedly before finishing this task. class_name: TrainWorker"
    # The first failure: Serve replaces the replica; the driver waits.
    assert w.trainer_state(2.0, _trainer("failed", "a", error=died)) == "restarting"
    assert w.trainer_state(5.0, _trainer("failed", "a", error=died)) == "restarting"  # not replaced yet
    assert w.trainer_state(30.0, _trainer("starting", "b", step=0)) == "starting"  # the replacement
    assert w.trainer_state(31.0, _trainer("training", "b", step=5)) == "training"
    assert w.failure is None and w.trainer_restarts == 1
    # The second failure is past trainer_service.max_restarts: stop, with the cause.
    assert w.trainer_state(60.0, _trainer("failed", "b", error="RuntimeError: engine step failed")) == "failed"
    assert w.failure == "the trainer failed: RuntimeError: engine step failed"
    s = w.summary()
    assert s["resume"] == "meshrl train --resume runs/x" and s["trainer_restarts"] == 1
    assert [i["kind"] for i in s["incidents"]] == ["trainer_failed", "trainer_restarted", "run_stopping"]


def test_a_trainer_not_back_within_the_restart_timeout_stops_the_run() -> None:
    w = Watchdog("runs/x", max_restarts=3, restart_timeout_s=100.0, started=0.0)
    assert w.trainer_state(0.0, _trainer("failed", "a", error="boom")) == "restarting"
    w.trainer_unreachable(50.0, "DEADLINE: no replica")  # being replaced
    assert w.trainer_state(99.0, _trainer("failed", "a", error="boom")) == "restarting"
    assert w.trainer_state(101.0, _trainer("failed", "a", error="boom")) == "failed"
    assert w.failure is not None and "not restarted within trainer_service.restart_timeout_s=100" in w.failure


def test_no_restarts_means_a_clear_stop_at_the_first_failure() -> None:
    w = Watchdog("runs/x", max_restarts=0, started=0.0)
    assert w.trainer_state(3.0, _trainer("failed", "a", error="ActorDiedError: rank 0")) == "failed"
    assert w.failure == "the trainer failed: ActorDiedError: rank 0"


def test_a_coordinator_outage_is_waited_for_within_a_bound() -> None:
    w = Watchdog("runs/x", started=0.0)
    w.coordinator_failed(10.0, "UNAVAILABLE: connection refused")
    w.coordinator_failed(20.0, "UNAVAILABLE: connection refused")
    w.coordinator_ok(25.0, coordinator_pb2.GetStatusResponse())
    assert w.failure is None
    assert [(i["kind"], i.get("down_s")) for i in w.incidents] == [("coordinator_unreachable", None),
                                                                   ("coordinator_back", 15.0)]
    w.coordinator_failed(100.0, "UNAVAILABLE")
    with pytest.raises(RunFailure, match="has not answered for 301 s"):
        w.coordinator_failed(401.0, "UNAVAILABLE")
    assert OUTAGE_LIMIT_S == 300.0


def test_failure_reports_are_told_once_and_a_halt_stops_the_run() -> None:
    w = Watchdog("runs/x", started=0.0)
    status = coordinator_pb2.GetStatusResponse()
    status.failures.add(source="rollout-1", error="InvalidArgument: endpoint e: results[0].item_id is ''", count=3)
    w.coordinator_ok(1.0, status)
    w.coordinator_ok(2.0, status)
    assert [i["kind"] for i in w.incidents] == ["rollout_failure"]
    status.halted_reason = "32 prompt groups failed in a row (...); last from rollout-1: InvalidArgument: ..."
    w.coordinator_ok(3.0, status)
    assert w.failure is not None and w.failure.startswith("leasing halted: 32 prompt groups failed in a row")


def test_serve_application_changes_are_reported_once() -> None:
    w = Watchdog("runs/x", started=0.0)
    w.serve_status(1.0, {"rollout": ("RUNNING", "")})
    w.serve_status(2.0, {"rollout": ("DEPLOYING", "replica crashed")})
    w.serve_status(3.0, {"rollout": ("DEPLOYING", "replica crashed")})
    w.serve_status(4.0, {"rollout": ("RUNNING", "")})
    assert [i["detail"] for i in w.incidents] == ["rollout: DEPLOYING: replica crashed", "rollout: RUNNING"]


def test_a_trainer_replica_replaced_without_a_seen_failed_state_counts_as_a_restart() -> None:
    """The trainer replica is replaced by Serve between two looks at it (its process died: OOM,
    node lost; or its 'failed' state was up for the ~30 s of Serve's 3 health checks while the
    driver was busy validating): the driver sees it unreachable, then a new replica at step 0.
    Watchdog.trainer_state counts a restart only for a replica seen in state 'failed', so
    trainer_restarts stays 0 and max_restarts is never enforced: a crash loop runs forever."""
    w = Watchdog("runs/x", max_restarts=1, restart_timeout_s=100.0, started=0.0)
    assert w.trainer_state(1.0, _trainer("training", "a", step=40)) == "training"
    w.trainer_unreachable(10.0, "ActorDiedError: the actor died unexpectedly")
    w.trainer_state(40.0, _trainer("starting", "b", step=0))
    w.trainer_state(45.0, _trainer("training", "b", step=30))
    first = w.trainer_restarts
    w.trainer_unreachable(60.0, "ActorDiedError: the actor died unexpectedly")
    w.trainer_state(90.0, _trainer("starting", "c", step=0))
    w.trainer_state(95.0, _trainer("training", "c", step=30))
    assert first == 1, f"the first replacement (a -> b) counted {first} restarts; incidents: {w.incidents}"
    assert w.failure is not None, (
        f"the second replacement (b -> c) is past max_restarts=1 and the run goes on; "
        f"trainer_restarts={w.trainer_restarts}")


def test_a_restart_slower_than_restart_timeout_stops_the_run() -> None:
    """trainer_service.restart_timeout_s: 'How long meshrl train waits for a restarted trainer
    replica to train again before it stops the run.' The deadline is only checked when the OLD
    replica reports 'failed' again; once Serve takes it down (unreachable while the new replica is
    built) the only bound is max(300 s, restart_timeout_s), and a replacement that arrives after
    the deadline clears it as 'trainer_restarted'. With restart_timeout_s=60, a restart of 250 s
    goes on."""
    w = Watchdog("runs/x", max_restarts=3, restart_timeout_s=60.0, started=0.0)
    assert w.trainer_state(0.0, _trainer("failed", "a", error="boom")) == "restarting"
    with pytest.raises(RunFailure, match="restart_timeout_s=60"):  # the driver's poll ends the watch with it
        for t in range(5, 250, 5):
            w.trainer_unreachable(float(t), "TimeoutError: no replica")  # a stopped, b being built
    assert w.failure is not None and "restart_timeout_s=60" in w.failure
    # a replacement that reports after the deadline (no unreachable look in between) stops it too
    late = Watchdog("runs/x", max_restarts=3, restart_timeout_s=60.0, started=0.0)
    late.trainer_state(0.0, _trainer("failed", "a", error="boom"))
    assert late.trainer_state(250.0, _trainer("starting", "b", step=0)) == "failed" and late.failure is not None
