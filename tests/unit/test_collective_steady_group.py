"""When a collective transport starts a version on its group without waiting at the rendezvous
(a steady group), and when the background check-in sends the next version back through it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from services.common.errors import DeadlineExceeded
from services.weights.transports.collective import CollectiveFetcher


class _Board:
    """The param server's rendezvous answer (fake: the real one is in the integration tests)."""

    def __init__(self, generation: int | None, hang: bool = False) -> None:
        self.generation = generation
        self.hang = hang
        self.requests: list[Any] = []

    async def rendezvous(self, request: Any, *, timeout_s: float) -> Any:
        self.requests.append(request)
        if self.hang:
            await asyncio.Event().wait()
        if self.generation is None:
            raise DeadlineExceeded("rendezvous: the sender did not reach this version")
        return SimpleNamespace(generation=self.generation)

    async def close(self) -> None:
        return None


def _fetcher(board: _Board) -> tuple[CollectiveFetcher, Any]:
    f = CollectiveFetcher("gloo", "127.0.0.1:1", consumer_id="rollout-0", group="g")
    f.client = board  # type: ignore[assignment]
    group = SimpleNamespace(generation=3, broken=False, abort=lambda: None)
    f.group = group  # type: ignore[assignment]
    return f, group


@pytest.mark.parametrize("answer", [3, 4, None], ids=["same generation", "new generation", "check-in failed"])
def test_a_background_check_in_decides_whether_the_next_version_waits_at_the_rendezvous(answer: int | None) -> None:
    async def main() -> None:
        f, group = _fetcher(_Board(answer))
        assert f._steady_group() is None  # no version went through yet: the rendezvous forms the group
        f._steady = True  # a version went through
        assert f._steady_group() is group
        # the next version starts on the group; its check-in runs alongside, and the version
        # finishes (steady again) before or after the check-in answers
        task = asyncio.create_task(f._check_in_later(f._rendezvous_request(7), group))
        f._steady = True
        await task
        assert f.client.requests[0].policy_version == 7  # type: ignore[attr-defined]
        assert f._steady_group() is (group if answer == 3 else None)
        assert f._steady_group() is (group if answer == 3 else None)  # and it stays decided

    asyncio.run(main())


def test_a_failed_version_cancels_its_check_in_and_drops_the_group() -> None:
    async def main() -> None:
        f, group = _fetcher(_Board(3, hang=True))
        f._steady = True
        assert f._steady_group() is group
        f._checking = asyncio.create_task(f._check_in_later(f._rendezvous_request(8), group))
        await asyncio.sleep(0)
        f.drop_group(failed=True)  # the version failed: its check-in is moot
        await asyncio.wait_for(f._checked_in(), timeout=5)  # returns at once, no error
        assert f.group is None and f._steady_group() is None

    asyncio.run(main())


def test_a_retired_generation_stops_the_steady_start_and_a_failure_is_reported_at_the_next_check_in() -> None:
    """Issue 21: a new generation answered while the first step waits on the steady group moves the
    version to it (GroupMoved); a failed version's generation rides in the next check-in."""
    from services.weights.transports.collective.group import GroupMoved

    async def main() -> None:
        f, group = _fetcher(_Board(4))
        f._steady = True
        assert f._steady_group() is group
        f._interrupt()  # nothing answered yet: keep waiting
        await f._check_in_later(f._rendezvous_request(7), group)
        with pytest.raises(GroupMoved) as moved:
            f._interrupt()
        assert moved.value.response.generation == 4
        assert f._rendezvous_request(8).failed_generation == 0  # the group was not failed
        f.drop_group(failed=True)
        assert f._rendezvous_request(8).failed_generation == 3 and f.group is None

    asyncio.run(main())


def test_a_check_in_that_says_the_version_is_gone_stops_the_steady_start_at_once() -> None:
    from services.common.errors import FailedPrecondition

    class _Gone(_Board):
        async def rendezvous(self, request: Any, *, timeout_s: float) -> Any:
            raise FailedPrecondition("version 7 is gone from this group (fetch the newer version)")

    async def main() -> None:
        f, group = _fetcher(_Gone(3))
        f._steady = True
        await f._check_in_later(f._rendezvous_request(7), f._steady_group() or group)
        with pytest.raises(FailedPrecondition, match="gone"):
            f._interrupt()

    asyncio.run(main())


def test_a_version_no_rollout_will_load_is_not_broadcast() -> None:
    """`announce` answers False once the run is stopping (CommitVersionResponse.stopping): the
    sender reads the export to its end and returns the announced ref without forming a group or
    waiting for receivers (which would hold the trainer's stop for the whole deadline)."""
    import torch

    from services.weights.transports.collective import CollectivePublisher

    read: list[int] = []
    board = _Board(generation=None, hang=True)

    def buckets() -> Any:
        for i in range(3):
            read.append(i)
            yield [(f"w{i}", torch.ones(4))]

    async def announce(ref: Any) -> bool:
        return False

    async def main() -> Any:
        pub = CollectivePublisher("gloo", "127.0.0.1:1", receivers=1, group="g", timeout_s=30, announce=announce)
        pub.client = board  # type: ignore[assignment]
        return await asyncio.wait_for(pub.publish(7, buckets()), timeout=10)

    ref = asyncio.run(main())
    assert ref.policy_version == 7 and read == [0, 1, 2]
    assert board.requests == [] and not ref.manifest_checksum


@pytest.mark.parametrize("announced", [True, False])
def test_a_broadcast_that_fails_after_announce_carries_the_version_it_made_current(announced: bool) -> None:
    """The trainer goes on from a version whose broadcast failed only if announce (CommitVersion)
    made it current: the sender's error says so, and the mark survives pickling (Ray)."""
    import pickle

    import torch

    from services.weights.transports.collective import CollectivePublisher

    async def announce(ref: Any) -> bool:
        return True

    async def main() -> None:
        pub = CollectivePublisher("gloo", "127.0.0.1:1", receivers=1, group="g", timeout_s=30,
                                  announce=announce if announced else None)
        pub.client = _Board(generation=None)  # type: ignore[assignment]  # the rendezvous fails
        with pytest.raises(DeadlineExceeded) as raised:
            await pub.publish(7, iter([[("w", torch.ones(4))]]))
        again = pickle.loads(pickle.dumps(raised.value))
        assert getattr(again, "announced_version", None) == (7 if announced else None)
        await pub.close()

    asyncio.run(main())
