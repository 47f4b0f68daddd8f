"""examples/environment_server/server.py keeps the contract `meshrl environment serve` keeps
(services/environment/core.py): sessions a dead client never closes expire, and a Step of a
closed or finished session is refused naming it, without acting."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshrl.v1 import common_pb2
from meshrl.v1 import environment_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def _example() -> Any:
    sys.path.insert(0, str(ROOT / "examples" / "environment_server"))
    try:
        import server as example  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    return example


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    """grpc.aio's context as the servicer uses it: abort raises."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def _start(sid: str) -> pb.StartRequest:
    return pb.StartRequest(session_id=sid, prompt=common_pb2.Prompt(ground_truth="3"))


def _call(turn: int) -> list[pb.ToolCall]:
    return [pb.ToolCall(id=f"c{turn}", name="add", arguments_json='{"a": 1, "b": 2}')]


def test_sessions_a_dead_client_never_closes_expire() -> None:
    """A rollout replica that dies mid-episode never sends Close. Without expiry its sessions were
    kept forever: max_sessions of them and every Start was RESOURCE_EXHAUSTED for the rest of
    the run (its prompts re-queued, never played)."""
    example = _example()

    async def go() -> None:
        t = [0.0]
        svc = example.EnvironmentService(max_sessions=2, session_ttl_s=10, clock=lambda: t[0])
        ctx = FakeContext()
        await svc.Start(_start("dead/0"), ctx)
        await svc.Start(_start("dead/1"), ctx)
        with pytest.raises(Aborted) as exc:
            await svc.Start(_start("live/0"), ctx)
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED  # full while they may still be in use
        t[0] = 11.0
        await svc.Start(_start("live/0"), ctx)  # the idle ones expired
        assert set(svc.sessions) == {"live/0"}
        with pytest.raises(Aborted) as exc:
            await svc.Step(pb.StepRequest(session_id="dead/0", turn=0, tool_calls=_call(0)), ctx)
        assert exc.value.code == grpc.StatusCode.NOT_FOUND and "dead/0" in exc.value.details

    asyncio.run(go())


def test_a_step_of_a_closed_or_finished_session_is_refused_naming_it() -> None:
    """A Step that lands after Close (a late duplicate) ran the episode again; a Step after the
    episode's last turn was refused as "turn 1 out of order; the next turn is 1"."""
    example = _example()

    async def go() -> None:
        svc = example.EnvironmentService()
        ctx = FakeContext()
        await svc.Start(_start("s/0"), ctx)
        await svc.Step(pb.StepRequest(session_id="s/0", turn=0, tool_calls=_call(0)), ctx)
        closed = await svc.Close(pb.CloseRequest(session_id="s/0"), ctx)
        with pytest.raises(Aborted) as exc:
            await svc.Step(pb.StepRequest(session_id="s/0", turn=1, tool_calls=_call(1)), ctx)
        assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "'s/0'" in exc.value.details and "closed" in exc.value.details
        assert svc.sessions["s/0"].episode.calls == 1  # the refused Step did not act
        assert await svc.Close(pb.CloseRequest(session_id="s/0"), ctx) == closed

        await svc.Start(_start("s/1"), ctx)
        assert (await svc.Step(pb.StepRequest(session_id="s/1", turn=0, assistant_text="3"), ctx)).done
        with pytest.raises(Aborted) as exc:
            await svc.Step(pb.StepRequest(session_id="s/1", turn=1, tool_calls=_call(1)), ctx)
        assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "'s/1'" in exc.value.details and "done" in exc.value.details

    asyncio.run(go())
