"""The collective transport with the gloo backend: two real processes (trainer rank 0 and one
rollout rank) meeting through a real param server over gRPC. The same code path runs nccl on the
GPU machine (tests/gpu/test_param_server_nccl.py) and hccl on Ascend."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time

import pytest

import services.common.config  # noqa: F401  (config tree first)
from services.common.errors import MissingDependency
from services.param_server.config import ParamServerConfig
from services.param_server.server import ParamServerServer

from . import collective_workers as workers


def run_pair(backend: str, sender_plan: list, receiver_plan: list, deadline_s: float = 240.0) -> dict:
    async def main() -> dict:
        server = ParamServerServer(ParamServerConfig(port=0))
        await server.start()
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [
            ctx.Process(target=workers.sender, args=(server.address, backend, sender_plan, results, 8.0), daemon=True),
            ctx.Process(target=workers.receiver, args=(server.address, backend, receiver_plan, results), daemon=True),
        ]
        for p in procs:
            p.start()
        got: dict = {}
        end = time.monotonic() + deadline_s
        try:
            while len(got) < len(sender_plan) + len(receiver_plan):
                try:
                    role, version, outcome, count = results.get_nowait()
                    got[(role, version)] = (outcome, count)
                except queue.Empty:
                    if time.monotonic() > end:
                        raise AssertionError(f"collective test timed out; results so far: {got}") from None
                    if not all(p.is_alive() for p in procs) and results.empty():
                        await asyncio.sleep(1.0)
                        if results.empty():
                            raise AssertionError(f"a worker died: {[p.exitcode for p in procs]}; results {got}") from None
                    await asyncio.sleep(0.1)
            got["versions"] = [s.policy_version for s in server.servicer.store.versions()]
            return got
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            await server.stop()

    return asyncio.run(main())


def test_gloo_broadcast_round_trip_corruption_stuck_peer_and_recovery() -> None:
    got = run_pair(
        "gloo",
        sender_plan=[(1, "ok"), (2, "ok"), (3, "hang"), (4, "ok")],
        receiver_plan=[(1, "ok", 60.0), (2, "corrupt", 60.0), (3, "ok", 3.0), (4, "ok", 60.0)],
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
    assert got["versions"] == [2, 4]  # 3 never completed; retention keeps the newest 2


def test_hccl_fails_fast_without_torch_npu() -> None:
    pytest.importorskip("torch")
    try:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch_npu is installed")
    from services.param_server.transports.collective import CollectiveFetcher, CollectivePublisher

    with pytest.raises(MissingDependency, match="torch_npu"):
        CollectivePublisher("hccl", "127.0.0.1:1", receivers=1)
    with pytest.raises(MissingDependency, match="CANN"):
        CollectiveFetcher("hccl", "127.0.0.1:1", consumer_id="r")
