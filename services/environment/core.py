"""The session table of an environment server: one `Environment` behind idempotent, bounded,
expiring sessions. No gRPC (servicer.py is the edge), no Ray; the clock is injected.

    table = SessionTable(env, max_sessions=4096, session_ttl_s=900)
    await table.start("L7/0", prompt)          # again with "L7/0": the stored answer, env untouched
    await table.step("L7/0", 0, text, calls)   # again with turn 0: the stored answer
    await table.step("L7/0", 1, text, calls)   # turn 2 before 1: FailedPrecondition
    await table.close("L7/0")                  # again: the stored answer

Why: the rollout's calls are delivered at least once (a timed-out call is sent again), so every
method must act once per key and answer repeats from what it stored. Calls racing on one key
(a retry while the first attempt still runs) share the first attempt's result. A session that
sees no call for `session_ttl_s` (its rollout died) is closed by `expire()`. Closed sessions'
answers are kept for a while (`closed_keep`) so a repeated Close still gets its reward, or the
error its close failed with (never an empty reward the trajectory would be trained on). A Close
of a session the table does not know is NotFound for the same reason. A close
waits `close_wait_s` at most for the session's calls still running (a hung tool), then cancels
them: one stuck session never holds the others' expiry up.

Bounds (the request came from a sampled turn, so none of them is an error): an assistant text over
`max_message_chars` is cut before the environment reads it, calls past `max_tool_calls` are
answered with tool errors without running, and an answer's messages are cut to
`max_message_chars` characters in all (limits.py) before the answer is stored. Unbounded, a tool
that prints a huge file makes an answer over the gRPC message limit: the client retries, the table
repeats the same stored answer, and the prompt fails on every replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import FailedPrecondition, MeshError, NotFound, ResourceExhausted
from services.common.logging import get_logger

from .base import CloseResult, Environment, EnvPrompt, StartResult, StepResult, ToolCall
from .limits import bound_messages, split_calls, truncate_text

log = get_logger(__name__)


@dataclass
class _Session:
    start: asyncio.Future[StartResult]
    last_seen: float
    steps: dict[int, asyncio.Future[StepResult]] = field(default_factory=dict)
    next_turn: int = 0
    done: bool = False
    closing: asyncio.Future[CloseResult] | None = None


@dataclass
class SessionCounters:
    started: int = 0
    steps: int = 0
    repeats: int = 0
    closed: int = 0
    expired: int = 0
    errors: int = 0
    truncated_messages: int = 0


class SessionTable:
    """Idempotent sessions over one Environment (see the module docstring)."""

    def __init__(
        self,
        env: Environment,
        *,
        max_sessions: int = 4096,
        session_ttl_s: float = 900.0,
        closed_keep: int = 4096,
        close_wait_s: float = 30.0,
        max_tool_calls: int = 64,
        max_message_chars: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.env = env
        self.max_sessions = max_sessions
        self.max_tool_calls = max_tool_calls
        self.max_message_chars = max_message_chars
        self.session_ttl_s = session_ttl_s
        self.closed_keep = closed_keep
        self.close_wait_s = close_wait_s
        self.clock = clock
        self._open: dict[str, _Session] = {}
        self._closed: OrderedDict[str, CloseResult | MeshError] = OrderedDict()
        self._expired: set[str] = set()  # those of _closed that expire() closed (NotFound to a Step)
        self.counters = SessionCounters()
        self._late_closes: set[asyncio.Future[Any]] = set()  # closes of starts that landed after their Close

    @property
    def open_sessions(self) -> int:
        return len(self._open)

    async def start(self, session_id: str, prompt: EnvPrompt, *, sample_index: int = 0, policy_version: int = 0) -> StartResult:
        s = self._open.get(session_id)
        if s is None:
            if session_id in self._closed:
                raise FailedPrecondition(f"session {session_id!r} is closed; start a new session id")
            if len(self._open) >= self.max_sessions:
                raise ResourceExhausted(
                    f"{len(self._open)} sessions open (environment.max_sessions={self.max_sessions}); retry later"
                )
            fut = asyncio.ensure_future(self.env.start(session_id, prompt, sample_index=sample_index, policy_version=policy_version))
            s = _Session(start=fut, last_seen=self.clock())
            self._open[session_id] = s
            self.counters.started += 1
        else:
            self.counters.repeats += 1
        s.last_seen = self.clock()
        try:
            return await asyncio.shield(s.start)
        except Exception:
            # A failed start leaves no session behind: the retry starts afresh.
            if self._open.get(session_id) is s and s.start.done():
                del self._open[session_id]
            self.counters.errors += 1
            raise

    def _session(self, session_id: str) -> _Session:
        s = self._open.get(session_id)
        if s is None:
            if session_id in self._closed and session_id not in self._expired:
                raise FailedPrecondition(f"session {session_id!r} is closed")
            raise NotFound(f"no session {session_id!r} (never started, or expired after {self.session_ttl_s:g}s idle)")
        if s.closing is not None:
            raise FailedPrecondition(f"session {session_id!r} is closing")
        return s

    async def step(
        self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *, policy_version: int = 0
    ) -> StepResult:
        s = self._session(session_id)
        if not s.start.done() or s.start.exception() is not None:
            raise FailedPrecondition(f"session {session_id!r} has not finished starting")
        fut = s.steps.get(turn)
        if fut is None:
            if turn != s.next_turn:
                raise FailedPrecondition(f"session {session_id!r}: turn {turn} out of order; the next turn is {s.next_turn}")
            prev = s.steps.get(turn - 1)
            if prev is not None and not prev.done():
                # turn k+1 only follows turn k's answer (which may end the episode)
                raise FailedPrecondition(f"session {session_id!r}: turn {turn} before turn {turn - 1} was answered")
            if s.done:
                raise FailedPrecondition(f"session {session_id!r} is done (turn {turn - 1} ended the episode)")
        s.last_seen = self.clock()  # only a call the session takes keeps it alive
        if fut is None:
            # Only the latest answer is kept: a repeat of an older turn cannot arrive once the
            # caller moved on (it waits for each answer before the next turn).
            s.steps = {}
            fut = asyncio.ensure_future(self._bounded_step(session_id, turn, assistant_text, tool_calls, policy_version))
            s.steps[turn] = fut
            s.next_turn = turn + 1
            self.counters.steps += 1
        else:
            self.counters.repeats += 1
        try:
            result = await asyncio.shield(fut)
        except Exception:
            if s.steps.get(turn) is fut and fut.done():
                # Let the caller retry the turn: forget the failed attempt.
                del s.steps[turn]
                s.next_turn = turn
            self.counters.errors += 1
            raise
        s.done = s.done or result.done
        return result

    async def _bounded_step(
        self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], policy_version: int
    ) -> StepResult:
        """env.step within the table's bounds (see the module docstring)."""
        text, _ = truncate_text(assistant_text, self.max_message_chars, "middle")
        run, refused = split_calls(tool_calls, self.max_tool_calls)
        r = await self.env.step(session_id, turn, text, run, policy_version=policy_version)
        messages, cut = bound_messages((*r.messages, *refused), self.max_message_chars)
        if not refused and not cut:
            return r
        metrics = dict(r.metrics)
        if cut:
            self.counters.truncated_messages += cut
            metrics["server_truncated_messages"] = metrics.get("server_truncated_messages", 0.0) + cut
        return dataclasses.replace(r, messages=messages, metrics=metrics, tool_errors=r.tool_errors + len(refused))

    async def close(self, session_id: str) -> CloseResult:
        if session_id in self._closed:
            self.counters.repeats += 1
            answer = self._closed[session_id]
            if isinstance(answer, MeshError):
                raise answer.with_traceback(None)  # each raise would pile its frames (and their locals) onto it
            return answer
        s = self._open.get(session_id)
        if s is None:
            # Never started here, or lost (this server restarted mid-episode; its answer is no
            # longer kept): the close reward is unknown, and an empty answer would have the
            # trajectory trained without it. The rollout's clean-up closes ignore this.
            raise NotFound(f"no session {session_id!r} (never started, lost in a restart of this server, or closed "
                           f"before the last {self.closed_keep} closes kept); its reward is unknown")
        if s.closing is None:
            s.closing = asyncio.ensure_future(self._close(session_id, s))
        return await asyncio.shield(s.closing)

    async def _close(self, session_id: str, s: _Session) -> CloseResult:
        answer: CloseResult | MeshError | None = None
        try:
            await self._settle(session_id, [s.start, *s.steps.values()])
            if not s.start.done():
                # it ignored its cancellation: what it opens is closed when it lands (no trajectory
                # waits on this session's reward)
                s.start.add_done_callback(lambda f: self._close_late(session_id, f))
                answer = CloseResult()
            elif s.start.cancelled() or s.start.exception() is None:  # a cancelled start may have begun
                answer = await self.env.close(session_id)
            else:
                answer = CloseResult()
        except Exception as exc:
            # The reward is unknown: a repeated Close (the client retries UNAVAILABLE) must fail
            # as well, never answer an empty reward the trajectory would be trained on.
            answer = FailedPrecondition(f"session {session_id!r}: its close failed ({exc!r}); its reward is unknown, "
                                        "so the trajectory must not be trained on")
            self.counters.errors += 1
            raise
        finally:
            self._open.pop(session_id, None)
            if answer is not None:
                self._closed[session_id] = answer
                while len(self._closed) > self.closed_keep:
                    self._expired.discard(self._closed.popitem(last=False)[0])
            else:
                self._expired.discard(session_id)
        self.counters.closed += 1
        return answer

    def _close_late(self, session_id: str, start: asyncio.Future[Any]) -> None:
        if not start.cancelled() and start.exception() is not None:
            return  # it failed: nothing to close
        task = asyncio.ensure_future(self.env.close(session_id))
        self._late_closes.add(task)
        task.add_done_callback(self._late_closed)

    def _late_closed(self, task: asyncio.Future[Any]) -> None:
        self._late_closes.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.counters.errors += 1
            log.warning("environment_late_close_failed", error=repr(exc))

    async def _settle(self, session_id: str, calls: list[asyncio.Future[Any]]) -> None:
        """Wait for the session's calls still running, `close_wait_s` at most, then cancel them."""
        running = [f for f in calls if not f.done()]
        if not running:
            return
        _, late = await asyncio.wait(running, timeout=self.close_wait_s)
        if late:
            log.warning("environment_calls_cancelled", session_id=session_id, calls=len(late),
                        hint=f"they ran past environment close_wait_s={self.close_wait_s:g}s (a hung tool?)")
            for f in late:
                f.cancel()
            await asyncio.wait(late, timeout=1.0)  # a call that ignores its cancellation is left behind

    async def expire(self) -> int:
        """Close sessions idle for more than session_ttl_s. Returns how many."""
        now = self.clock()
        stale = [sid for sid, s in self._open.items() if s.closing is None and now - s.last_seen > self.session_ttl_s]
        self._expired.update(stale)
        outcomes = await asyncio.gather(*(self.close(sid) for sid in stale), return_exceptions=True)  # all at once
        for sid, outcome in zip(stale, outcomes, strict=True):
            if isinstance(outcome, Exception):  # one bad session must not stop the sweep
                log.warning("environment_session_close_failed", session_id=sid, error=repr(outcome))
            self.counters.expired += 1
        if stale:
            log.info("environment_sessions_expired", sessions=len(stale))
        return len(stale)

    async def close_all(self) -> int:
        """Close every open session (a server that stops: what they hold is released). Returns how many."""
        sids = list(self._open)
        outcomes = await asyncio.gather(*(self.close(sid) for sid in sids), return_exceptions=True)
        for sid, outcome in zip(sids, outcomes, strict=True):
            if isinstance(outcome, Exception):
                log.warning("environment_session_close_failed", session_id=sid, error=repr(outcome))
        return len(sids)

    def status(self) -> dict[str, Any]:
        return {
            "open_sessions": len(self._open),
            "environment": self.env.status(),
            **self.counters.__dict__,
        }
