"""ToolEnvironment: the in-process environment of verl-style tools and interactions (what verl's
ToolAgentLoop does between generations, as an `Environment`).

Per assistant turn (Step):
- tool calls present: run up to `max_parallel_calls` of them concurrently; each answer is one
  `tool` message, in call order. A call that did not parse, names an unknown tool, has arguments
  that are not a JSON object, or whose tool raises is answered with an error text and counted in
  `tool_errors` (verl's behaviour); calls beyond `max_parallel_calls` are answered with an error
  saying so (verl drops them silently), and a call that runs past `call_timeout_s`
  (`multi_turn.tool_timeout_s`) is cancelled and answered with an error. The episode goes on.
  Error answers are marked (`Message.error`): the rollout shows them whole, as verl does, and cuts
  only a tool's own responses to `max_tool_response_length`.
- no tool calls, an interaction configured: the interaction writes the next `user` message and may
  end the episode with a turn score.
- otherwise the episode is done.

Tool instances are created lazily, one per (session, tool), with the prompt's
`extra_info.tools_kwargs[<tool>].create_kwargs`; at Close each instance's `calc_reward` is summed
into the close reward and the instance released. The environment's reward of a trajectory is the
sum of the tools' step rewards, the interaction's turn scores and the close reward. All three are
read by one rule: a reward that is not a finite number (a judge's NaN) counts as 0.0, and is
counted in `bad_rewards` and logged, so one bad score neither reaches the trainer nor fails the
group (a tool's missing reward, None, is 0.0 as in verl). Metrics likewise: a numeric value that
is not a finite float (NaN, an int past a float's range) and a turn's sum of one metric over its
calls that overflows are dropped, counted in `bad_metrics` and logged (a served environment's
client refuses a non-finite metric as a bad reply, failing the group); other values (text) are not
metrics and are left out.

Every other call of user code (a tool's create, calc_reward and release, an interaction's methods)
is bounded by `call_timeout_s` too: past it, it is cancelled and DeadlineExceeded raised (the
group fails and its prompt is re-queued), where it would have held the group and its lease,
renewed while tools run, forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import DeadlineExceeded, InvalidArgument, NotFound
from services.common.logging import get_logger

from .base import CloseResult, Environment, EnvPrompt, Message, StartResult, StepResult, ToolCall
from .tools import BaseInteraction, BaseTool, ToolResponse

log = get_logger(__name__)


@dataclass
class _Session:
    history: list[dict[str, Any]]
    tools_kwargs: Mapping[str, Any]
    interaction: BaseInteraction | None = None
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)


def _finite(value: Any) -> float | None:
    """`value` as a finite float, or None when it is not one."""
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


def _check_extra_info(extra: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """(tools_kwargs, interaction_kwargs) of a prompt's extra_info, their shapes checked before a
    session is created (the data is at fault, not the server: INVALID_ARGUMENT naming the key)."""
    field = "prompt.extra_info_json"
    tools_kwargs = extra.get("tools_kwargs") or {}
    if not isinstance(tools_kwargs, Mapping):
        raise InvalidArgument(f"{field}.tools_kwargs", f"must be an object of tool name -> kwargs, got {type(tools_kwargs).__name__}")
    for tool, kw in tools_kwargs.items():
        if not isinstance(kw, Mapping) or not isinstance(kw.get("create_kwargs") or {}, Mapping):
            raise InvalidArgument(f"{field}.tools_kwargs.{tool}", 'must be an object like {"create_kwargs": {...}}')
    ikw = extra.get("interaction_kwargs") or {}
    if not isinstance(ikw, Mapping):
        raise InvalidArgument(f"{field}.interaction_kwargs", f"must be an object, got {type(ikw).__name__}")
    if not isinstance(ikw.get("name", ""), str):
        raise InvalidArgument(f"{field}.interaction_kwargs.name", "must be a string (an interaction's name)")
    if "instance_id" in ikw:
        raise InvalidArgument(f"{field}.interaction_kwargs.instance_id", "is reserved (the session id is the instance id)")
    return tools_kwargs, dict(ikw)


class ToolEnvironment(Environment):
    """verl tools (+ interactions) as an Environment (see the module docstring)."""

    def __init__(
        self,
        tools: Sequence[BaseTool] = (),
        interactions: Mapping[str, BaseInteraction] | None = None,
        *,
        max_parallel_calls: int = 1,
        call_timeout_s: float | None = None,
        name: str = "tools",
    ) -> None:
        self.tools = {t.name: t for t in tools}
        self.interactions = dict(interactions or {})
        self.max_parallel_calls = max(1, max_parallel_calls)
        self.call_timeout_s = call_timeout_s  # nothing else bounds an in-process call
        self.name = name
        self.schemas = tuple(t.tool_schema.model_dump(exclude_none=True) for t in tools)
        self._sessions: dict[str, _Session] = {}
        self.calls = 0
        self.errors = 0
        self.bad_rewards = 0
        self.bad_metrics = 0
        self._late_releases: set[asyncio.Future[Any]] = set()  # instances created after their sample was cancelled

    async def start(self, session_id: str, prompt: EnvPrompt, *, sample_index: int = 0, policy_version: int = 0) -> StartResult:
        tools_kwargs, ikw = _check_extra_info(prompt.extra_info)
        interaction = None
        if self.interactions:
            name = ikw.get("name")
            if name is None and len(self.interactions) == 1:
                name = next(iter(self.interactions))
            if name not in self.interactions:
                raise InvalidArgument(
                    "prompt.extra_info.interaction_kwargs.name",
                    f"{name!r} is not a configured interaction ({sorted(self.interactions)}); set it in the data",
                )
            interaction = self.interactions[name]
            async with self._bounded(f"interaction {name}: start_interaction"):
                await interaction.start_interaction(session_id, **ikw)
        history = [m.as_dict() for m in prompt.messages] or [{"role": "user", "content": prompt.text}]
        self._sessions[session_id] = _Session(history, tools_kwargs, interaction, ikw)
        return StartResult(tools=self.schemas)

    def _session(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise NotFound(f"no tool session {session_id!r}")
        return s

    async def step(
        self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *, policy_version: int = 0
    ) -> StepResult:
        s = self._session(session_id)
        # The history grows only once the turn succeeded: a failed turn is retried (core.py) and
        # must not leave its assistant message twice in what an interaction reads.
        assistant = {"role": "assistant", "content": assistant_text}
        if tool_calls:
            result = await self._run_calls(session_id, s, list(tool_calls))
        elif s.interaction is not None:
            async with self._bounded(f"interaction {type(s.interaction).__name__}: generate_response"):
                terminate, content, score, metrics = await s.interaction.generate_response(
                    session_id, [*s.history, assistant], **s.interaction_kwargs)
            reward = None if score is None else self._reward(score, f"interaction {type(s.interaction).__name__} turn score")
            result = StepResult(messages=(Message("user", str(content)),), done=bool(terminate), reward=reward,
                                metrics=self._metrics(metrics, f"interaction {type(s.interaction).__name__}"))
        else:
            result = StepResult(done=True)
        s.history.append(assistant)
        s.history.extend(m.as_dict() for m in result.messages)
        return result

    async def _run_calls(self, session_id: str, s: _Session, calls: list[ToolCall]) -> StepResult:
        run, extra = calls[: self.max_parallel_calls], calls[self.max_parallel_calls :]
        # Instances first, one at a time: two calls of one tool in a turn share its instance.
        for c in run:
            if not c.parse_error and c.name in self.tools and c.name not in s.instances:
                await self._create(session_id, s, c.name)
        outcomes = await asyncio.gather(*(self._call(s, c) for c in run))
        limit = (f"Error: more than {self.max_parallel_calls} tool calls in one turn; "
                 f"this call was not run (max_parallel_calls={self.max_parallel_calls})")
        outcomes.extend((limit, 0.0, {}, True) for _ in extra)
        reward = sum(o[1] for o in outcomes)
        sums: dict[str, float] = {}
        for _, _, m, _ in outcomes:
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
        # each value is finite, their sum may not be (1e308 twice); inf + -inf is NaN, so a key
        # once overflowed stays dropped
        metrics = {k: v for k, v in sums.items() if math.isfinite(v)}
        for k in sums.keys() - metrics.keys():
            self._bad_metric(f"the sum of metric {k!r} over the turn's tool calls", sums[k])
        errors = sum(1 for o in outcomes if o[3])
        self.calls += len(calls)
        self.errors += errors
        msgs = tuple(Message("tool", o[0], error=o[3]) for o in outcomes)
        return StepResult(messages=msgs, done=False, reward=reward, metrics=metrics, tool_errors=errors)

    async def _create(self, session_id: str, s: _Session, name: str) -> None:
        ck = dict((s.tools_kwargs.get(name) or {}).get("create_kwargs") or {})
        ck.pop("instance_id", None)
        ck.pop("create_kwargs", None)
        tool = self.tools[name]
        creating = asyncio.ensure_future(tool.create(f"{session_id}/{name}", create_kwargs=dict(ck), **ck))
        try:
            async with self._bounded(f"tool {name}: create"):
                instance_id, _ = await asyncio.shield(creating)
        except (asyncio.CancelledError, DeadlineExceeded):
            # The sample was cancelled mid-create (a sibling failed, a drain) or the create hung:
            # the session's close cannot know this instance, so it is released when the create
            # lands (a sandbox, a container).
            creating.add_done_callback(lambda f: self._release_late(tool, f))
            raise
        s.instances[name] = instance_id

    def _release_late(self, tool: BaseTool, created: asyncio.Future[Any]) -> None:
        if created.cancelled() or created.exception() is not None:
            return  # nothing was created
        task = asyncio.ensure_future(tool.release(created.result()[0]))
        self._late_releases.add(task)
        task.add_done_callback(self._late_released)

    def _late_released(self, task: asyncio.Future[Any]) -> None:
        self._late_releases.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("tool_late_release_failed", error=repr(exc))

    async def _call(self, s: _Session, c: ToolCall) -> tuple[str, float, dict[str, float], bool]:
        """(response text, step reward, metrics, is_error) of one call; never raises."""
        if c.parse_error:
            return f"Error: the tool call could not be parsed: {c.parse_error}", 0.0, {}, True
        tool = self.tools.get(c.name)
        if tool is None:
            return f"Error: unknown tool {c.name!r}; available tools: {sorted(self.tools)}", 0.0, {}, True
        try:
            params = c.arguments()
        except ValueError as exc:
            return f"Error: invalid arguments for {c.name}: {exc}", 0.0, {}, True
        try:
            async with self._bounded(f"tool {c.name}: execute"):
                resp, reward, metrics = await tool.execute(s.instances[c.name], params)
        except DeadlineExceeded:
            return (f"Error: tool {c.name} did not answer within {self.call_timeout_s:g}s and was cancelled "
                    "(actor_rollout_ref.rollout.multi_turn.tool_timeout_s)", 0.0, {}, True)
        except Exception as exc:  # noqa: BLE001 - a failing tool is answered with its error (verl), not raised
            return f"Error when executing tool {c.name}: {exc}", 0.0, {}, True
        text = resp if isinstance(resp, str) else (resp.text or "") if isinstance(resp, ToolResponse) else str(resp)
        return text, self._reward(reward, f"tool {c.name} step reward"), self._metrics(metrics, f"tool {c.name}"), False

    @contextlib.asynccontextmanager
    async def _bounded(self, what: str) -> AsyncIterator[None]:
        """Its body cancelled past `call_timeout_s`, then DeadlineExceeded naming `what` (a
        TimeoutError the body raises itself, its own HTTP client's, passes as it is)."""
        deadline = asyncio.timeout(self.call_timeout_s)
        try:
            async with deadline:
                yield
        except TimeoutError:
            if not deadline.expired():
                raise
            raise DeadlineExceeded(f"{what} did not finish within {self.call_timeout_s:g}s "
                                   "(actor_rollout_ref.rollout.multi_turn.tool_timeout_s); raise it or fix it") from None

    def _metrics(self, metrics: Any, what: str) -> dict[str, float]:
        """The numeric values of a tool's or an interaction's metrics; one that is not a finite
        float is dropped (counted, logged), as a reward that is not one counts as 0.0."""
        out: dict[str, float] = {}
        if not isinstance(metrics, Mapping):
            return out
        for k, v in metrics.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue  # not a number: not a metric
            x = _finite(v)  # float() of an int past a float's range raises OverflowError
            if x is None:
                self._bad_metric(f"{what} metric {str(k)!r}", v)
            else:
                out[str(k)] = x
        return out

    def _bad_metric(self, what: str, value: Any) -> None:
        self.bad_metrics += 1
        if self.bad_metrics in (1, 10, 100, 1000):
            log.warning("environment_metric_not_finite", what=what, value=repr(value)[:80], times=self.bad_metrics,
                        hint="dropped; the tool or interaction should return finite numbers of a float's range")

    def _reward(self, value: Any, what: str) -> float:
        """A tool's or an interaction's reward; 0.0 (counted, logged) for one that is not a finite number."""
        if value is None:
            return 0.0
        x = _finite(value)
        if x is None:
            self.bad_rewards += 1
            if self.bad_rewards in (1, 10, 100, 1000):
                log.warning("environment_reward_not_finite", what=what, value=repr(value)[:80], times=self.bad_rewards,
                            hint="counted as 0.0; the tool or interaction should return a finite number")
            return 0.0
        return x

    async def close(self, session_id: str) -> CloseResult:
        s = self._sessions.pop(session_id, None)
        if s is None:
            return CloseResult()
        # Every instance is released and the interaction finalized whatever fails on the way
        # (the first error is raised after: the session's reward is then unknown).
        reward = 0.0
        error: BaseException | None = None
        for name, instance_id in s.instances.items():
            tool = self.tools[name]
            try:
                async with self._bounded(f"tool {name}: calc_reward"):
                    value = await tool.calc_reward(instance_id)
                reward += self._reward(value, f"tool {name} calc_reward")
            except Exception as exc:  # noqa: BLE001 - raised below, after the others are released
                error = error or exc
            try:
                async with self._bounded(f"tool {name}: release"):
                    await tool.release(instance_id)
            except Exception as exc:  # noqa: BLE001
                error = error or exc
        if s.interaction is not None:
            fin = s.interaction.finalize_interaction
            params = inspect.signature(fin).parameters
            try:
                async with self._bounded(f"interaction {type(s.interaction).__name__}: finalize_interaction"):
                    await (fin(session_id) if params else fin())
            except Exception as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error
        return CloseResult(reward=reward)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "tools", "tools": sorted(self.tools), "interactions": sorted(self.interactions),
                "open_sessions": len(self._sessions), "calls": self.calls, "errors": self.errors,
                "bad_rewards": self.bad_rewards, "bad_metrics": self.bad_metrics}
