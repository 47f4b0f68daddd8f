"""Helpers shared by the rollout tests: a loop in a thread (engines that bind to one loop, like
vLLM's AsyncLLM, outlive a single test), engine builders, a hand-written fake coordinator and a
scorer, and the reference logprobs the trainer would compute."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine, Sequence
from typing import Any, TypeVar

import torch

from meshrl.v1 import common_pb2, coordinator_pb2, reward_pb2

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running in a daemon thread; `run(coro)` blocks for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T] | Awaitable[T], timeout_s: float = 300.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def build_engine(name: str, model: Any, tok: Any, tmp_dir: str, **kw: Any) -> Any:
    from services.rollout.engines import get_engine_cls

    cls = get_engine_cls(name)
    if name == "transformers":
        return cls(model, tok, max_num_seqs=kw.pop("max_num_seqs", 16), **kw)
    from services.rollout.engines.vllm_engine import save_model_dir

    path = save_model_dir(model, tok, tmp_dir)
    args = dict(model=path, max_model_len=256, dtype="float32", max_num_seqs=16, enable_prefix_caching=True)
    args.update(kw)
    return cls(args, tok)


def reference_logprobs(model: Any, prompt: Sequence[int], tokens: Sequence[int], temperature: float) -> torch.Tensor:
    """What the trainer computes: log_softmax(logits / T) at each response token (T=1 for greedy)."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / t, dim=-1)
    return lp.gather(-1, torch.tensor(list(tokens))[:, None]).squeeze(-1)


def chat_prompts(n: int) -> list[common_pb2.Prompt]:
    """n chat prompts "what is i+i?" (prompt_seq i, ground truth i)."""
    out = []
    for i in range(n):
        p = common_pb2.Prompt(prompt_seq=i, prompt_id=f"train:{i}", ground_truth=str(i), data_source="test")
        p.messages.add(role="user", content=f"what is {i}+{i}?")
        out.append(p)
    return out


async def length_scorer(items: list[reward_pb2.ScoreItem]) -> list[reward_pb2.ScoreResult]:
    """A real (if simple) reward: fraction of digits in the response."""
    out = []
    for it in items:
        text = it.response_text
        frac = sum(c.isdigit() for c in text) / max(1, len(text))
        out.append(reward_pb2.ScoreResult(item_id=it.item_id, score=frac, metrics={"len": float(len(text))}))
    return out


class FakeCoordinator:
    """Hand-written coordinator for unit tests: hands out `prompts` as leases, records submits,
    and lets a test push versions to WatchVersions. Stricter than the real one: a lease returned
    after it was submitted or returned, or submitted after it was returned, fails the call with
    an AssertionError (the worker must release each lease once). `submit_gate` (when set) holds
    every SubmitGroups call until the test sets it; `submit_error` makes them fail."""

    def __init__(self, prompts: list[common_pb2.Prompt], sampling: common_pb2.SamplingParams,
                 current: common_pb2.WeightsRef | None = None) -> None:
        self.prompts = list(prompts)
        self.current = current or common_pb2.WeightsRef(policy_version=0)
        self.watch_delay_s = 0.0
        self.lease_version = 0
        """The policy_version leases are granted at (the real coordinator's current version)."""
        self.sampling = sampling
        self.submitted: list[common_pb2.TrajectoryGroup] = []
        self.returned: list[str] = []
        self.errors: list[str] = []
        """ReturnLeases `error`s: why the worker gave leases back."""
        self.renewed: list[str] = []
        self.lost: set[str] = set()
        self.active: dict[str, common_pb2.Prompt] = {}
        self.submit_gate: asyncio.Event | None = None
        self.submit_error: BaseException | None = None
        self.submits_started = 0
        self._ids = itertools.count()
        self._versions: asyncio.Queue[coordinator_pb2.WatchVersionsResponse] = asyncio.Queue()

    async def lease(self, replica_id: str, max_groups: int) -> coordinator_pb2.LeasePromptsResponse:
        resp = coordinator_pb2.LeasePromptsResponse(sampling=self.sampling, limit=coordinator_pb2.LEASE_LIMIT_NONE)
        while self.prompts and len(resp.leases) < max_groups:
            p = self.prompts.pop(0)
            lid = f"L{next(self._ids)}"
            self.active[lid] = p
            resp.leases.add(lease_id=lid, prompt=p, deadline_unix_s=time.time() + 60, policy_version=self.lease_version)
        if not resp.leases:
            resp.limit = coordinator_pb2.LEASE_LIMIT_EXHAUSTED
        return resp

    async def renew(self, replica_id: str, lease_ids: Sequence[str]) -> coordinator_pb2.RenewLeasesResponse:
        self.renewed.extend(lease_ids)
        lost = [i for i in lease_ids if i in self.lost]
        return coordinator_pb2.RenewLeasesResponse(renewed=[i for i in lease_ids if i not in self.lost], lost=lost)

    async def return_leases(self, replica_id: str, lease_ids: Sequence[str], error: str = "") -> int:
        if error:
            self.errors.append(error)
        done = {g.lease_id for g in self.submitted} | set(self.returned)
        twice = [lid for lid in lease_ids if lid in done]
        assert not twice, f"leases {twice} returned after they were submitted or returned"
        for lid in lease_ids:
            self.prompts.append(self.active.pop(lid))
        self.returned.extend(lease_ids)
        return len(lease_ids)

    async def submit(
        self, replica_id: str, groups: Sequence[common_pb2.TrajectoryGroup]
    ) -> coordinator_pb2.SubmitGroupsResponse:
        self.submits_started += 1
        if self.submit_gate is not None:
            await self.submit_gate.wait()
        if self.submit_error is not None:
            raise self.submit_error
        back = [g.lease_id for g in groups if g.lease_id in self.returned]
        assert not back, f"leases {back} submitted after they were returned"
        statuses = []
        for g in groups:
            self.active.pop(g.lease_id, None)
            self.submitted.append(g)
            statuses.append(coordinator_pb2.SUBMIT_STATUS_ACCEPTED)
        return coordinator_pb2.SubmitGroupsResponse(statuses=statuses)

    def push_version(self, ref: common_pb2.WeightsRef) -> None:
        self._versions.put_nowait(coordinator_pb2.WatchVersionsResponse(weights=ref))

    async def watch_versions(self, replica_id: str) -> AsyncIterator[coordinator_pb2.WatchVersionsResponse]:
        await asyncio.sleep(self.watch_delay_s)
        yield coordinator_pb2.WatchVersionsResponse(weights=self.current)
        while True:
            yield await self._versions.get()


async def wait_for(cond: Any, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)
