"""Benchmark bookkeeping: the coordinator bench's groups are ones the coordinator accepts, each cycle
starts with an empty queue, and every result carries its date and machine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from meshrl.bench import coordinator as cb
from meshrl.v1 import common_pb2, coordinator_pb2
from services.coordinator.convert import groups_from_request


def test_the_coordinator_bench_submits_groups_the_coordinator_accepts() -> None:
    lease = coordinator_pb2.PromptLease(lease_id="l1", prompt=common_pb2.Prompt(prompt_seq=1))
    req = coordinator_pb2.SubmitGroupsRequest(replica_id="r", groups=[cb._group(lease)])
    (g,) = groups_from_request(req, max_groups=1, max_tokens=1024, expected_n=cb.N_RESPONSES)
    assert g is not None


class _FakeClient:
    """Leases and submits queue groups; fetches take them; status reports the queue."""

    def __init__(self, *a: Any, **k: Any) -> None:
        self.queued = 0
        self.n = 0

    async def __aenter__(self) -> _FakeClient:
        return self

    async def __aexit__(self, *a: Any) -> None:
        return None

    async def wait_ready(self, _t: float) -> None:
        return None

    async def echo(self, payload: bytes) -> None:
        await asyncio.sleep(0)

    async def lease(self, _r: str, k: int) -> Any:
        await asyncio.sleep(0)
        self.n += k
        return coordinator_pb2.LeasePromptsResponse(
            leases=[coordinator_pb2.PromptLease(lease_id=f"l{self.n}-{i}") for i in range(k)])

    async def submit(self, _r: str, groups: list) -> None:
        await asyncio.sleep(0)
        self.queued += len(groups)

    async def fetch_batch(self, _t: str, _step: int, k: int, timeout_ms: int = 0) -> Any:
        await asyncio.sleep(0)
        took = min(k, self.queued)
        self.queued -= took
        return coordinator_pb2.FetchBatchResponse(groups=[common_pb2.TrajectoryGroup()] * took)

    async def status(self) -> Any:
        return type("S", (), {"totals": type("T", (), {"queued": self.queued})()})()


def test_each_cycle_starts_with_an_empty_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    starts: list[int] = []
    orig = cb._cycle

    async def cycle(c: Any, batch: int, seconds: float) -> dict[str, float]:
        starts.append(c.queued)
        c.queued += 100  # what a cycle leaves queued: its rollouts outpace its trainer
        return await orig(c, batch, 0.01)

    monkeypatch.setattr(cb, "CoordinatorClient", _FakeClient)
    monkeypatch.setattr(cb, "_cycle", cycle)
    asyncio.run(cb._measure("x", None, 0.01))
    assert starts == [0, 0], f"queued groups at each cycle's start: {starts}"


def test_every_bench_result_carries_date_and_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from meshrl import cli
    from meshrl.bench import trainer

    monkeypatch.setattr(trainer, "run_benchmark", lambda **k: {"benchmark": "trainer"})
    out = tmp_path / "t.json"
    assert cli.main(["bench", "trainer", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["date"] and r["machine"]["cpus"]
