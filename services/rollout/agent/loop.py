"""AgentLoop: one leased prompt played out over turns, for each of its n samples, on any
RolloutEngine (the contract in engines/base.py; nothing engine-specific here).

    for each sample i (concurrently):       env = router.route(prompt.data_source)
      Start(session "<rid>/<i>")            -> messages to start from, tools, turn limit
      loop:
        engine.generate(exact ids so far)   -> an assistant turn (loss mask 1, logprobs, versions)
        parse <tool_call> blocks            -> Step(session, turn, text, calls)
        a limit is hit                      -> stop
        tokenize only the new messages      -> environment tokens (loss mask 0), appended
        Step says done                      -> stop (after its messages, appended as verl does)
      Close(session)                        -> final reward, metrics

Each turn continues from the exact token ids generated so far (token-in/token-out, chat.py); the
policy's tokens are never re-tokenized. While one trajectory waits for its environment, the
engine keeps decoding the others (its continuous batching sees only the turns that are ready), so
no slot idles on I/O. A weight update inside a turn: with partial rollout `keep` the engine carries
on; with `abort` the turn comes back cut and is continued from prompt + everything so far (its new
tokens carry the new version); between turns nothing special happens. Limits (verl's meanings):
the response budget (`data.max_response_length`, policy + environment tokens; tool responses
that would cross it are not appended, an interaction's user turn is appended cut at it, and the
trajectory ends with `length`),
`max_assistant_turns` (and the environment's own), `max_user_turns`. Tool responses (role `tool`)
longer than `max_tool_response_length` characters are truncated (`tool_response_truncate_side`);
other environment messages (an interaction's user turns) and the error texts answering calls that
could not run are kept whole, as verl keeps them, bounded by the response budget and the context (and,
against a runaway, cut to `environment.max_message_chars`, as a served environment's answer is).

Failures: an environment error (after its endpoint's retry budget) fails the group; the worker
returns the lease and the prompt is re-queued (counted), never scored. That includes an
environment's InvalidArgument and a reward that is not finite (raised as BadReply): the worker
stops a replica on InvalidArgument, its own bad input, and one sampled turn an environment refuses
is not that. Sessions are always closed: a close, once begun, runs to its end even when its sample
is cancelled (a sibling failed, a drain), and a failed group closes the sessions whose samples
never reached their close before it raises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from meshrl.v1 import common_pb2
from services.common.errors import BadReply, FailedPrecondition, InvalidArgument
from services.common.jsonutil import DEFAULT_MAX_DEPTH
from services.common.logging import get_logger
from services.environment import convert as env_convert
from services.environment.base import CloseResult, Environment, Message, StartResult
from services.environment.factory import EnvironmentRouter
from services.environment.limits import TruncateSide, truncate_text

from ..engines.base import Finish, GenerationRequest, SampleOutput, SamplingSpec, stop_across
from .chat import ChatRenderer, SanityMode
from .group import build_group
from .parser import parse_tool_calls
from .trajectory import Trajectory

log = get_logger(__name__)

GenerateFn = Callable[[GenerationRequest], Awaitable[list[SampleOutput]]]
"""The worker's engine.generate (tracked per group, so aborts and drains reach it)."""
T = TypeVar("T")


@dataclass(frozen=True)
class AgentSettings:
    """`actor_rollout_ref.rollout.multi_turn` plus the worker's prompt rules."""

    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_tool_response_length: int = 256
    tool_response_truncate_side: TruncateSide = "middle"
    sanity_mode: SanityMode = "strict"
    max_resubmits: int = 64
    max_prompt_length: int | None = None
    truncation: Literal["error", "left", "right", "middle"] = "error"
    reward_source: Literal["reward_service", "environment", "sum"] = "reward_service"
    """environment.reward_source: reward_service, environment or sum."""
    max_json_depth: int = DEFAULT_MAX_DEPTH
    """security.limits.max_json_depth: a prompt's extra_info nests at most this deep."""
    max_model_len: int | None = None
    """The engine's context length: environment tokens that would leave no room for the next turn
    are treated as at the response budget (tool responses not appended, a user turn cut; `length`)."""
    max_message_chars: int = 1 << 20
    """environment.max_message_chars: a message kept whole (an error text, a user turn) is still cut
    to this many characters (in the middle, counted), the bound a served environment's answer has.
    Unbounded, a tool that raised with a huge message was tokenized whole in the event loop (and
    again by the drift check) before the response budget dropped it."""


@dataclass
class AgentCounters:
    trajectories: int = 0
    assistant_turns: int = 0
    environment_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated_messages: int = 0
    env_calls: int = 0
    env_seconds: float = 0.0
    tokenization_drift: int = 0
    delta_fallbacks: int = 0


async def _env_call(env: Environment, call: str, sid: str, aw: Awaitable[T]) -> T:
    """`aw` (a call of `env`), its InvalidArgument raised as BadReply: the group fails and its lease
    goes back with the error (the coordinator counts it, and halts on a run of them), where an
    InvalidArgument would stop the whole replica as if its own input were bad."""
    try:
        return await aw
    except InvalidArgument as exc:
        raise BadReply(f"environment {env.name!r}", f"{call} of session {sid} refused: {exc}") from exc


def truncate_prompt(ids: list[int], limit: int | None, truncation: Literal["error", "left", "right", "middle"],
                    prompt_id: str) -> list[int]:
    """A first prompt held to data.max_prompt_length per data.truncation (error: InvalidArgument).
    Shared with the gateway (sessions.py), which holds an agent's first prompt to the same rule."""
    if limit is None or len(ids) <= limit:
        return ids
    if truncation == "left":
        return ids[-limit:]
    if truncation == "right":
        return ids[:limit]
    if truncation == "middle":
        head = limit // 2
        return ids[:head] + ids[len(ids) - (limit - head) :]
    raise InvalidArgument(
        "prompt", f"{prompt_id or 'prompt'} has {len(ids)} tokens (chat template and tools applied) > "
        f"data.max_prompt_length={limit}; raise it or set data.truncation=left|right|middle",
    )


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """How many leading ids all rows share: a group's prompt (also the gateway's, runner.py)."""
    first = rows[0]
    n = min(len(r) for r in rows)
    for k in range(n):
        if any(r[k] != first[k] for r in rows[1:]):
            return k
    return n


@dataclass
class _Sample:
    index: int
    sid: str
    start: StartResult
    messages: list[dict[str, Any]]
    renderer: ChatRenderer
    ids: list[int]
    closing: asyncio.Future[CloseResult] | None = None
    """Its env.close once begun (shielded: it runs to its end whoever is cancelled)."""
    close_failure_seen: bool = False


class AgentLoop:
    """Plays groups out over turns (see the module docstring). One per rollout replica."""

    def __init__(self, tokenizer: Any, router: EnvironmentRouter, settings: AgentSettings) -> None:
        self.tok = tokenizer
        self.router = router
        self.s = settings
        self.counters = AgentCounters()

    async def run_group(
        self,
        prompt: common_pb2.Prompt,
        spec: SamplingSpec,
        rid: str,
        generate: GenerateFn,
        cancelled: Callable[[], bool],
        version: Callable[[], int],
    ) -> tuple[list[int], list[Trajectory]]:
        """(the group's prompt ids, one trajectory per sample). `cancelled()` true stops continuing
        turns cut by an abort (the caller then drops the group). Raises what an environment raised
        (every session closed)."""
        env = self.router.route(prompt.data_source)
        env_prompt = env_convert.prompt_from_proto(prompt, max_depth=self.s.max_json_depth)
        messages = [m.as_dict() for m in env_prompt.messages] or [{"role": "user", "content": prompt.text}]
        sids = [f"{rid}/{i}" for i in range(spec.n)]
        try:
            starts = await asyncio.gather(
                *(_env_call(env, "Start", sid, env.start(sid, env_prompt, sample_index=i, policy_version=version()))
                  for i, sid in enumerate(sids)),
                return_exceptions=True,
            )
            failed = next((s for s in starts if isinstance(s, BaseException)), None)
            if failed is not None:
                raise failed
            samples = []
            for i, (sid, start) in enumerate(zip(sids, starts, strict=True)):
                assert isinstance(start, StartResult)
                msgs = [m.as_dict() for m in start.messages] or [dict(m) for m in messages]
                renderer = ChatRenderer(self.tok, start.tools)
                ids = truncate_prompt(renderer.prompt_ids(msgs), self.s.max_prompt_length, self.s.truncation, prompt.prompt_id)
                samples.append(_Sample(i, sid, start, msgs, renderer, ids))
        except BaseException:
            # Every session, also one whose start failed here but may have landed (a timed-out
            # call); one never started answers NotFound, ignored here. Shielded: a cancelled group
            # (drain, stop) still frees the environment's sessions.
            await asyncio.shield(asyncio.gather(*(env.close(sid) for sid in sids), return_exceptions=True))
            raise
        # Samples whose environment starts them differently share the common prefix as the
        # group's prompt; each one's remainder opens its trajectory as environment tokens.
        prompt_ids = samples[0].ids[: common_prefix([s.ids for s in samples])]
        tasks = [asyncio.ensure_future(self._run_one(s, env, prompt_ids, spec, generate, cancelled, version)) for s in samples]
        try:
            trajectories = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._close_all(env, samples)
            raise
        self.counters.trajectories += len(trajectories)
        return prompt_ids, list(trajectories)

    async def play(
        self,
        prompt: common_pb2.Prompt,
        spec: SamplingSpec,
        rid: str,
        lease_id: str,
        replica_id: str,
        generate: GenerateFn,
        *,
        cancelled: Callable[[], bool],
        version: Callable[[], int],
    ) -> common_pb2.TrajectoryGroup:
        """run_group, as the TrajectoryGroup the coordinator takes (rewards not set yet)."""
        t0 = time.monotonic()
        prompt_ids, trajectories = await self.run_group(prompt, spec, rid, generate, cancelled, version)
        return build_group(lease_id=lease_id, prompt=prompt, prompt_ids=prompt_ids, trajectories=trajectories,
                           replica_id=replica_id, fallback_version=version(), generation_s=time.monotonic() - t0)

    async def _run_one(
        self, s: _Sample, env: Environment, prompt_ids: list[int], spec: SamplingSpec, generate: GenerateFn,
        cancelled: Callable[[], bool], version: Callable[[], int],
    ) -> Trajectory:
        t = Trajectory(index=s.index)
        own = s.ids[len(prompt_ids) :]  # the rest of this sample's own first prompt (the group shares the prefix)
        if len(own) >= spec.max_tokens:
            # it would fill the response budget before the policy's first token; submitted, the
            # coordinator refuses the response as over max_tokens
            await self._close(env, s, t, raise_errors=False)
            raise FailedPrecondition(
                f"sample {s.index}'s first prompt differs from the group's shared prefix by {len(own)} tokens, "
                f">= the response budget ({spec.max_tokens}); raise data.max_response_length or have the "
                "environment start the group's samples alike"
            )
        t.add_environment(own)
        ctx = list(s.ids)
        history = list(s.messages)
        limits = [x for x in (self.s.max_assistant_turns, s.start.max_turns) if x]
        max_turns = min(limits) if limits else None
        generated_end, ended_on_assistant, user_turns = "", False, 0
        unappended: list[int] = []  # the end of the episode's last message, past the budget
        ok = False
        turn = -1
        try:
            while True:
                turn += 1
                left = spec.max_tokens - len(t)
                if left <= 0:
                    t.finish_reason = Finish.LENGTH
                    break
                ids, lps, vers, finish, resumes = await self._generate_turn(s, turn, ctx, left, spec, generate, cancelled)
                t.num_resumes += resumes
                if ids:
                    t.add_policy(ids, lps, vers)
                    ctx += ids
                    t.num_turns += 1
                    self.counters.assistant_turns += 1
                text = str(self.tok.decode(ids, skip_special_tokens=True))
                t.final_text = text
                history.append({"role": "assistant", "content": text})
                generated_end = str(self.tok.decode(ids[-1:], skip_special_tokens=False)) if ids else ""
                ended_on_assistant = True
                t.finish_reason = finish
                if finish is not Finish.STOP:
                    break  # length: the budget or the context is full; abort: cancelled
                if max_turns is not None and t.num_turns >= max_turns:
                    break
                if self.s.max_user_turns is not None and user_turns >= self.s.max_user_turns:
                    break
                _, calls = parse_tool_calls(text, turn)
                t0 = time.monotonic()
                step = await _env_call(env, "Step", s.sid,
                                       env.step(s.sid, turn, text, calls, policy_version=max(vers) if vers else version()))
                dt = time.monotonic() - t0
                self.counters.env_calls += 1
                self.counters.env_seconds += dt
                t.add_metrics({"env_latency_s": dt})
                parse_errors = sum(1 for c in calls if c.parse_error)
                t.tool_calls += len(calls)
                t.tool_errors += max(step.tool_errors, parse_errors)
                self.counters.tool_calls += len(calls)
                self.counters.tool_errors += max(step.tool_errors, parse_errors)
                t.add_reward(step.reward, source=f"environment {env.name!r}")
                t.add_metrics(step.metrics)
                if step.done and not step.messages:
                    break
                new = self._truncated(step.messages, t)
                env_ids = s.renderer.env_ids(history[:-1], history[-1], new, generated_end)
                room = spec.max_tokens - len(t)
                if self.s.max_model_len is not None:
                    room = min(room, self.s.max_model_len - len(ctx))
                room = max(room, 0)
                crosses = len(env_ids) >= room
                if step.done or (crosses and not any(m["role"] == "tool" for m in new)):
                    # verl appends an interaction's user message (loss mask 0) without a budget check
                    # and cuts its response at the budget at the end: the response, and its length
                    # (DAPO's overlong shaping), ends with the message, cut there past the budget (or
                    # the context), and no turn follows. An episode that ended is still `stop`; one
                    # cut is `length`. The drift check reads the whole message.
                    t.add_environment(env_ids[:room])
                    unappended = env_ids[room:]
                    history.extend(new)
                    ended_on_assistant = False
                    self.counters.environment_turns += 1
                    if not step.done:
                        user_turns += 1
                        t.finish_reason = Finish.LENGTH
                    break
                if crosses:
                    t.finish_reason = Finish.LENGTH  # verl: tool responses that do not fit are not appended
                    break
                t.add_environment(env_ids)
                ctx += env_ids
                history.extend(new)
                ended_on_assistant = False
                user_turns += 1
                self.counters.environment_turns += 1
            ok = True
        finally:
            await self._close(env, s, t, raise_errors=ok)
        t.text = str(self.tok.decode(t.token_ids, skip_special_tokens=False))
        if s.renderer.check_drift(prompt_ids + t.token_ids + unappended, history, ended_on_assistant=ended_on_assistant,
                                  generated_end=generated_end, mode=self.s.sanity_mode):
            self.counters.tokenization_drift += 1
            if self.counters.tokenization_drift in (1, 10, 100, 1000):
                log.warning("tokenization_drift", trajectories=self.counters.tokenization_drift,
                            hint="the incremental ids differ from a full re-tokenization (multi_turn.tokenization_sanity_check_mode)")
        self.counters.delta_fallbacks += s.renderer.delta_fallbacks
        s.renderer.delta_fallbacks = 0
        return t

    def _decode_raw(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))

    async def _generate_turn(
        self, s: _Sample, turn: int, ctx: list[int], left: int, spec: SamplingSpec, generate: GenerateFn,
        cancelled: Callable[[], bool],
    ) -> tuple[list[int], list[float], list[int], Finish, int]:
        """One assistant turn: generate, and continue it after an abort (partial rollout, mode
        abort: re-prefilled on the new weights) until it stops, runs out of budget or is cancelled."""
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        resumes = 0
        for round_ in range(self.s.max_resubmits + 1):
            remaining = left - len(ids)
            if remaining <= 0:
                return ids, lps, vers, Finish.LENGTH, resumes
            seed = None if spec.seed is None else (spec.seed + s.index + 7919 * turn + 104_729 * round_ + len(ids)) % (1 << 63)
            sub = dataclasses.replace(spec, n=1, max_tokens=remaining, seed=seed)
            rid = f"{s.sid}/t{turn}" + (f"/r{round_}" if round_ else "")
            (out,) = await generate(GenerationRequest(rid, ctx + ids, sub))
            boundary = len(ids)
            ids += out.token_ids
            lps += out.logprobs
            vers += out.versions
            resumes += out.num_resumes
            cut = stop_across(self._decode_raw, ids, boundary, spec.stop) if round_ else None
            if cut is not None:  # a stop string across the cut: the engine could not see it
                del ids[cut:], lps[cut:], vers[cut:]
                return ids, lps, vers, Finish.STOP, resumes
            if out.finish_reason is not Finish.ABORT:
                return ids, lps, vers, out.finish_reason, resumes
            if cancelled():
                break
            resumes += 1
        return ids, lps, vers, Finish.ABORT, resumes

    def _truncated(self, messages: Sequence[Message], t: Trajectory) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            # verl cuts a tool's own response only: an interaction's user turn and the error text
            # answering a call that could not run (verl's "Error when executing tool") stay whole, up
            # to a bound no real message reaches (a tool that raised with a whole file in its message)
            if m.role != "tool" or m.error:
                content, cut = truncate_text(m.content, self.s.max_message_chars, "middle")
            else:
                content, cut = truncate_text(m.content, self.s.max_tool_response_length, self.s.tool_response_truncate_side)
            if cut:
                self.counters.truncated_messages += 1
                t.add_metrics({"truncated_messages": 1.0})
            out.append({"role": m.role, "content": content})
        return out

    async def _close(self, env: Environment, s: _Sample, t: Trajectory, *, raise_errors: bool) -> None:
        # Shielded: a close cancelled half-way (a sibling sample failed, a drain) would leak the
        # session (in-process: its tool instances are never released; remote: it stays open until
        # the server's session_ttl_s). run_group waits for it before it raises.
        s.closing = asyncio.ensure_future(_env_call(env, "Close", s.sid, env.close(s.sid)))
        try:
            closed = await asyncio.shield(s.closing)
        except Exception as exc:
            s.close_failure_seen = True
            if raise_errors:
                raise
            log.warning("environment_close_failed", session_id=s.sid, error=repr(exc))
            return
        t.add_reward(closed.reward, source=f"environment {env.name!r}")
        t.add_metrics(closed.metrics)

    async def _close_all(self, env: Environment, samples: Sequence[_Sample]) -> None:
        """After a failed group: wait for the closes its samples began, and close the sessions of
        samples that never reached theirs (cancelled before they ran). Shielded, like each close."""
        closes = [s.closing or asyncio.ensure_future(env.close(s.sid)) for s in samples]
        outcomes = await asyncio.shield(asyncio.gather(*closes, return_exceptions=True))
        for s, outcome in zip(samples, outcomes, strict=True):
            if isinstance(outcome, Exception) and not s.close_failure_seen:  # else its sample raised or logged it
                log.warning("environment_close_failed", session_id=s.sid, error=repr(outcome))

    async def aclose(self) -> None:
        await self.router.aclose()

    def status(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.counters), "environments": self.router.status()}


def settings_from_config(
    multi_turn: Any, *, max_prompt_length: int | None, truncation: Literal["error", "left", "right", "middle"],
    max_resubmits: int, reward_source: Literal["reward_service", "environment", "sum"],
    max_json_depth: int = DEFAULT_MAX_DEPTH, max_model_len: int | None = None, max_message_chars: int = 1 << 20,
) -> AgentSettings:
    mt = multi_turn
    return AgentSettings(
        max_assistant_turns=mt.max_assistant_turns, max_user_turns=mt.max_user_turns,
        max_tool_response_length=mt.max_tool_response_length, tool_response_truncate_side=mt.tool_response_truncate_side,
        sanity_mode=mt.tokenization_sanity_check_mode, max_resubmits=max_resubmits, max_prompt_length=max_prompt_length,
        truncation=truncation, reward_source=reward_source, max_json_depth=max_json_depth, max_model_len=max_model_len,
        max_message_chars=max_message_chars,
    )

