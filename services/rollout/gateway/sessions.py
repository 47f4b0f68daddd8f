"""Gateway sessions: one leased prompt group = n sample sessions, each with its own API key;
every model call of a sample is recorded as tokens and stitched into one trajectory.

    GroupSession (lease, n)  ─► SampleSession i: id, key, segments
        call k:  auth (key of this session, hmac.compare_digest)  → 401
                 validate the body                                 → 400 (field named)
                 state: finished / failed                          → 409
                 staleness: engine version - oldest policy token > max_staleness_versions → 409,
                           the sample starts over in a new session (runner.py restarts its agent
                           within the same lease; the other samples keep their work)
                 stitch:   the request's messages = the last call's messages + the assistant reply we
                           returned + new messages  → env tokens = the chat template's delta of the new
                           messages (chat.py), appended to the exact ids so far (never re-tokenized);
                           else, when the full render's token ids start with the ids so far (a prefix
                           match on token ids) → the rest are env tokens; anything else starts a new
                           segment (counted in `stitch_mismatches`)
                 generate on the rollout engine (continued after an abort by a weight update)
        finish:  POST /finish {reward?}

Trajectory of a sample = its last segment: prompt ids, then environment tokens (mask 0: what the
agent added — tool results, user turns, its own assistant messages) and completion tokens (mask 1,
with logprob and version). Earlier segments of a sample whose history did not extend are dropped
(their tokens were not the context of the final answer) and counted. Ordering: calls of one
sample are serialized (a per-sample lock); samples run concurrently.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.logging import get_logger
from services.environment.base import ToolCall

from ..agent.chat import ChatRenderer
from ..agent.loop import truncate_prompt
from ..agent.parser import parse_tool_calls
from ..agent.trajectory import Trajectory
from ..engines.base import Finish, GenerationRequest, SampleOutput, SamplingSpec, stop_across
from .openai_api import ApiError, ChatRequest, Completion, CompletionRequest, bad, now

log = get_logger(__name__)

GenerateFn = Callable[[GenerationRequest], Awaitable[list[SampleOutput]]]
OnToken = Callable[[int, float], None]
"""Streaming: (token id, logprob) of each completion token as it is sampled."""
State = Literal["open", "finished", "failed"]


@dataclass
class Segment:
    """One run of calls whose histories extend each other: a prompt and what followed it."""

    kind: Literal["chat", "completion"]
    prompt_ids: list[int]
    traj: Trajectory
    tools_key: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """Chat: the history as the model saw it (assistant content = the exact sampled text)."""
    request_messages: list[dict[str, Any]] = field(default_factory=list)
    """Chat: the last request's messages plus the assistant reply as returned (what a client echoes)."""
    generated_end: str = ""
    text: str = ""
    """Completion: the last prompt plus its completion (what a continuing prompt starts with)."""
    shown: str = ""
    """Completion: the last prompt plus its completion as returned, cut at a stop string (what a
    client continues that does not add the stop string back)."""
    last_text: str = ""
    spent: int = 0
    """Response budget spent before its trajectory: its prompt's tokens past the sample's first
    prompt (a new segment's prompt holds the turns so far when the agent keeps its own copy)."""
    calls: int = 0
    tool_calls: int = 0
    tool_errors: int = 0


@dataclass
class SampleSession:
    id: str
    key: str
    index: int
    group: GroupSession
    state: State = "open"
    reward: float | None = None
    segments: list[Segment] = field(default_factory=list)
    calls: int = 0
    stitch_mismatches: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    restart: str | None = None
    """Why this sample must start over (its tokens fell past max_staleness_versions); the runner
    then replaces it with a fresh session of the same index."""
    responses: int = 0
    """Response ids handed out (response_id)."""
    refused: str = ""
    """Why its last refused call was refused (a 4xx's message): the group's error says it when the
    sample ends with no call recorded, where an agent that caught the error left no other trace."""

    def response_id(self, prefix: str) -> str:
        """An id no other response of this session carries: taken with no await before it is
        counted (a stream's chunks carry it before its call holds the session's lock)."""
        self.responses += 1
        return f"{prefix}-{self.id[:12]}-{self.responses}"


@dataclass
class GroupSession:
    rid: str
    spec: SamplingSpec
    generate: GenerateFn
    version: Callable[[], int]
    samples: list[SampleSession] = field(default_factory=list)
    failure: str | None = None
    check_staleness: bool = True
    """False for a group that holds no lease (a Generate call: validation): it is not trained on and
    there is no lease to return, so max_staleness_versions does not apply (nor in the in-process loop)."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    generating: set[asyncio.Future[Any]] = field(default_factory=set)
    """The engine requests of its calls under way: cancelled (the engines abort them) once the
    group has ended, so a failed group's calls stop taking engine slots and KV cache."""

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        for s in self.samples:
            if s.state == "open":
                s.state = "failed"
        self.changed.set()
        self.stop_generating()

    def stop_generating(self) -> None:
        for call in self.generating:
            call.cancel()

    @property
    def done(self) -> bool:
        return self.failure is not None or all(s.state == "finished" for s in self.samples)


@dataclass(frozen=True)
class GatewayLimits:
    max_model_len: int
    """Prompt + completion tokens of one call (the engine's context)."""
    response_budget: int
    """Tokens of a sample after its first prompt (completions and everything the agent added):
    data.max_response_length, as for the in-process agent loop."""
    max_prompt_length: int | None = None
    """data.max_prompt_length: a sample's first prompt (chat template and tools applied) is held to
    it as the in-process agent loop holds its prompt, per `truncation`; None: not checked."""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """data.truncation: error answers a first prompt over max_prompt_length with a 400 naming it."""
    max_staleness_versions: int | None = None
    max_calls_per_sample: int = 64
    max_resubmits: int = 64
    """async_training.max_resubmits: continuations of one call cut by weight updates (503 beyond)."""
    max_sample_restarts: int = 3
    """Times one sample may start over (staleness) within its lease before the group is returned."""
    model_name: str = "meshrl-policy"
    ended_sessions_kept: int = 4096
    """Ended sessions remembered (their calls answer 409, not 401) before their keys are forgotten."""


def _call_key(m: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must agree for a message the client echoes to count as the one we sent/saw."""
    calls = tuple((c["name"], _canon_args(c["arguments"])) for c in m.get("tool_calls", ()))
    return (m["role"], m.get("content") or "", calls, m.get("tool_call_id", ""))


def _canon_args(args: str) -> str:
    try:
        return json.dumps(json.loads(args), sort_keys=True)
    except (ValueError, RecursionError):  # compared as given (ValueError: also an int past Python's digit limit)
        return args


_RENDERERS_KEPT = 256
_RENDERER_BYTES_KEPT = 16 << 20


class SessionRegistry:
    """Every open session of one replica, by id. Used from one asyncio loop."""

    def __init__(self, tokenizer: Any, limits: GatewayLimits) -> None:
        self.tok = tokenizer
        self.limits = limits
        self._open: dict[str, SampleSession] = {}
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()
        """Ended sessions: id -> (key, why), without their tokens."""
        self._renderers: dict[str, ChatRenderer] = {}
        self._renderer_key_bytes = 0
        self.counters = {"calls": 0, "stitched_calls": 0, "stitch_mismatches": 0, "rejected_stale": 0,
                         "rejected_auth": 0, "segments_dropped": 0}

    # ---- lifecycle --------------------------------------------------------------------------------

    def open_group(self, rid: str, spec: SamplingSpec, generate: GenerateFn, version: Callable[[], int], *,
                   check_staleness: bool = True) -> GroupSession:
        g = GroupSession(rid, spec, generate, version, check_staleness=check_staleness)
        for i in range(spec.n):
            sid = uuid.uuid4().hex
            s = SampleSession(sid, secrets.token_urlsafe(32), i, g)
            g.samples.append(s)
            self._open[sid] = s
        return g

    def close_group(self, g: GroupSession) -> None:
        """The group ended (submitted or failed): its keys stop working for model calls (409 for a
        while, then 401)."""
        for s in g.samples:
            if s.state == "open":
                s.state = "failed"
            self._open.pop(s.id, None)
            why = g.failure if s.state == "failed" and g.failure else "its group has ended"
            self._ended[s.id] = (s.key, why)
        while len(self._ended) > self.limits.ended_sessions_kept:
            self._ended.popitem(last=False)
        g.stop_generating()

    @staticmethod
    def stop_strings(s: SampleSession, requested: Sequence[str]) -> tuple[str, ...]:
        """The run's stop strings (`actor_rollout_ref.rollout.stop`) and the request's: a call
        stops at either (an agent's own `stop` does not lift the run's)."""
        return tuple(dict.fromkeys((*s.group.spec.stop, *requested)))

    def authenticate(self, session_id: str, authorization: str | None) -> SampleSession:
        """The open session whose key the bearer token is. ApiError(401) for a wrong key or an
        unknown session (so ids cannot be probed), 409 for a session whose group has ended (with the
        right key; forgotten after `ended_sessions_kept` more, then 401)."""
        key = ""
        if authorization and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        s = self._open.get(session_id)
        ended = self._ended.get(session_id) if s is None else None
        expected = s.key if s is not None else ended[0] if ended is not None else None
        if expected is None or not key or not hmac.compare_digest(expected.encode(), key.encode()):
            self.counters["rejected_auth"] += 1
            raise ApiError(401, "Incorrect API key provided for this session: use the OPENAI_API_KEY meshrl gave the "
                           "agent with this session's base URL", code="invalid_api_key")
        if ended is not None:
            raise ApiError(409, f"session {session_id} takes no more calls: {ended[1]}", code="session_closed")
        assert s is not None
        return s

    async def finish(self, s: SampleSession, reward: float | None) -> None:
        """End the sample (after any call of it in flight: the group is built from what it recorded)."""
        async with s.lock:
            self._check_open(s)
            s.reward = reward
            s.state = "finished"
            s.group.changed.set()

    def restart_sample(self, s: SampleSession) -> SampleSession:
        """A fresh session (new id and key, nothing recorded) in place of `s` in its group, same
        sample index; `s` ends (its key answers 409 with the reason)."""
        g = s.group
        new = SampleSession(uuid.uuid4().hex, secrets.token_urlsafe(32), s.index, g)
        g.samples[g.samples.index(s)] = new
        if s.state == "open" or s.state == "finished":
            s.state = "failed"
        self._open.pop(s.id, None)
        self._ended[s.id] = (s.key, f"this sample started over in a new session ({s.restart or 'restarted'})")
        self._open[new.id] = new
        return new

    def stale_reason(self, s: SampleSession) -> str | None:
        """Why the sample's tokens are past max_staleness_versions now, else None."""
        eta = self.limits.max_staleness_versions
        seg = s.segments[-1] if s.segments else None
        if eta is None or seg is None or not s.group.check_staleness:
            return None  # (a group without a lease, validation's, is not trained on)
        versions = seg.traj.policy_versions()
        if versions and s.group.version() - min(versions) > eta:
            return (f"the policy moved to version {s.group.version()} while this sample holds tokens of version "
                    f"{min(versions)}, more than async_training.max_staleness_versions={eta} behind; the sample "
                    "starts over in a new session of the same lease (the other samples keep their work)")
        return None

    def _check_open(self, s: SampleSession) -> None:
        if s.state != "open":
            why = s.restart if s.restart else \
                s.group.failure if s.state == "failed" and s.group.failure else f"the session is {s.state}"
            raise ApiError(409, f"session {s.id} takes no more calls: {why}", code="session_closed")

    # ---- calls ------------------------------------------------------------------------------------

    def _renderer(self, tools: Sequence[Mapping[str, Any]]) -> tuple[ChatRenderer, str]:
        key = json.dumps(list(tools), sort_keys=True)
        r = self._renderers.get(key)
        if r is None:
            try:
                made = ChatRenderer(self.tok, tools)
            except Exception as exc:  # the schemas are the caller's: its fault, said so (no renderer kept)
                raise bad("tools", f"the chat template cannot use them ({type(exc).__name__}: {exc})") from exc
            # bounded in count and in the tool schemas' bytes (each may be up to max_request_bytes)
            if len(self._renderers) >= _RENDERERS_KEPT or self._renderer_key_bytes + len(key) > _RENDERER_BYTES_KEPT:
                self._renderers.clear()
                self._renderer_key_bytes = 0
            r = self._renderers[key] = made
            self._renderer_key_bytes += len(key)
        return r, key

    def _check_staleness(self, s: SampleSession) -> None:
        reason = self.stale_reason(s)
        if reason is not None:
            self.counters["rejected_stale"] += 1
            s.restart = reason
            s.state = "failed"
            s.group.changed.set()
            raise ApiError(409, reason, code="policy_too_stale")

    async def chat(self, s: SampleSession, req: ChatRequest, on_token: OnToken | None = None) -> Completion:
        """One chat call; `on_token(token_id, logprob)` sees each completion token as it is sampled
        (streaming; all of them before this returns, including those of a continuation after an
        abort), where the engine streams."""
        try:
            return await self._chat(s, req, on_token)
        except ApiError as exc:
            s.refused = exc.message
            raise

    async def complete(self, s: SampleSession, req: CompletionRequest, on_token: OnToken | None = None) -> Completion:
        """One text completion call (as chat)."""
        try:
            return await self._complete(s, req, on_token)
        except ApiError as exc:
            s.refused = exc.message
            raise

    async def _chat(self, s: SampleSession, req: ChatRequest, on_token: OnToken | None) -> Completion:
        async with s.lock:
            # tool_choice=none keeps the tools in the context (OpenAI; vLLM's server renders them
            # too) and only forbids calls: rendered without them, an "answer now" call after tool
            # rounds would not extend the trajectory. Its output is not parsed for calls.
            renderer, tools_key = self._renderer(req.tools)
            parse_calls = bool(req.tools) and req.tool_choice != "none"
            seg = s.segments[-1] if s.segments else None
            env_ids: list[int]
            stitched = (
                seg is not None and seg.kind == "chat" and seg.tools_key == tools_key
                and len(req.messages) > len(seg.request_messages)
                and [_call_key(m) for m in req.messages[: len(seg.request_messages)]]
                == [_call_key(m) for m in seg.request_messages]
            )
            new_msgs = [_template_message(m) for m in req.messages[len(seg.request_messages):]] if stitched and seg else []
            if stitched and seg is not None:
                try:
                    env_ids = renderer.env_ids(seg.messages[:-1], seg.messages[-1], new_msgs, seg.generated_end)
                except ApiError:
                    raise
                except Exception as exc:  # as for a full render: the new messages are the request's
                    raise bad("messages", f"the chat template cannot render them ({type(exc).__name__}: {exc})") from exc
                prompt_ids, ctx = seg.prompt_ids, seg.prompt_ids + seg.traj.token_ids + env_ids
                traj_len = seg.spent + len(seg.traj) + len(env_ids)
            else:
                env_ids = []
                try:
                    full_ids = renderer.prompt_ids([_template_message(m) for m in req.messages])
                except Exception as exc:  # a template error is the request's fault
                    raise bad("messages", f"the chat template cannot render them ({exc})") from exc
                full_ids = self._first_prompt(s, full_ids)
                prompt_ids, ctx, traj_len = full_ids, full_ids, _spent_before(s, full_ids)
                # Second chance, on token ids: the messages differ from what we returned (an agent
                # that rewrites its copy) yet render to the exact ids so far plus more.
                if seg is not None and seg.kind == "chat" and seg.tools_key == tools_key:
                    so_far = seg.prompt_ids + seg.traj.token_ids
                    if len(full_ids) > len(so_far) and full_ids[: len(so_far)] == so_far:
                        stitched = True
                        env_ids = full_ids[len(so_far):]
                        new_msgs = []
                        prompt_ids, traj_len = seg.prompt_ids, seg.spent + len(seg.traj) + len(env_ids)
            # After the body's validation (tools, messages, the context: a 400 first) since staleness changes state
            try:
                self._check_context(len(ctx))
                self._check_open(s)
                self._check_calls(s)
                self._check_staleness(s)
                max_tokens = self._max_tokens(len(ctx), traj_len, req.max_tokens)
            except ApiError as exc:
                _ends_truncated(s, exc)
                raise
            stop = self.stop_strings(s, req.stop)
            ids, lps, vers, finish = await self._generate(s, ctx, max_tokens, stop, on_token)
            raw = str(self.tok.decode(ids, skip_special_tokens=True))
            # Parsed before the commit: an error in it must leave the session as it was (a half-recorded
            # call would be the context of the client's retry).
            # Ids numbered by the session's calls, not the segment's: an agent keeping its own history
            # across a new segment (and frameworks keying tool results by id) saw call_0_0 again.
            parsed = parse_tool_calls(raw, s.calls) if parse_calls else None
            # Commit (no await from here on): the call happened.
            if stitched and seg is not None and not new_msgs:  # stitched on token ids
                seg.messages = [_template_message(m) for m in req.messages]
            if not stitched or seg is None:
                if s.segments:
                    s.stitch_mismatches += 1
                    self.counters["stitch_mismatches"] += 1
                    self.counters["segments_dropped"] += 1
                seg = Segment("chat", prompt_ids, Trajectory(index=s.index), tools_key=tools_key,
                              messages=[_template_message(m) for m in req.messages], spent=traj_len)
                s.segments.append(seg)
            else:
                seg.traj.add_environment(env_ids)
                seg.messages.extend(new_msgs)
                self.counters["stitched_calls"] += 1
            seg.traj.add_policy(ids, lps, vers)
            seg.traj.num_turns += 1
            seg.traj.finish_reason = finish
            seg.messages.append({"role": "assistant", "content": raw})
            seg.generated_end = str(self.tok.decode(ids[-1:], skip_special_tokens=False)) if ids else ""
            content = raw
            calls: list[ToolCall] = []
            if parsed is not None:
                text, calls = parsed
                if any(c.parse_error for c in calls):
                    # Every call the policy wrote counts, malformed ones too, as the in-process loop
                    # counts them (agent/tool_error_rate is errors per call; without them it passed
                    # 1). A turn cut before it stopped (its last block unclosed) is neither: the loop
                    # does not parse a cut turn.
                    if finish is Finish.STOP:
                        seg.tool_calls += len(calls)
                        seg.tool_errors += len([c for c in calls if c.parse_error])
                    calls = []  # answered as plain text: the agent sees what the policy wrote
                else:
                    content = text
                    seg.tool_calls += len(calls)
            content = _cut_stop(content, stop) if finish is Finish.STOP else content
            seg.last_text = raw
            seg.calls += 1
            s.calls += 1
            self.counters["calls"] += 1
            reply: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else ""}
            if calls:
                reply["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments_json} for c in calls]
            seg.request_messages = [*req.messages, reply]
            return self._completion(s, "chatcmpl", req.model, content, calls, finish, ids, lps, len(ctx))

    async def _complete(self, s: SampleSession, req: CompletionRequest, on_token: OnToken | None) -> Completion:
        async with s.lock:
            seg = s.segments[-1] if s.segments else None
            # The prompt continues the completion as sampled, or as returned (a stop string cut off: the
            # policy's tokens keep it, as a chat call's echo of cut content continues the raw turn).
            # A completion cut at its max_tokens continues as it is (an agent generating in chunks
            # adds nothing): a new segment dropped the sampled tokens so far from training.
            whole = seg.text if seg is not None and seg.traj.finish_reason is Finish.LENGTH else None
            known = next((k for k in ((seg.text, seg.shown) if seg is not None and seg.kind == "completion" else ())
                          if k and req.prompt.startswith(k) and (len(req.prompt) > len(k) or k == whole)), None)
            stitched = known is not None
            if known is not None and seg is not None:
                env_ids = list(self.tok.encode(req.prompt[len(known):], add_special_tokens=False))
                prompt_ids, ctx = seg.prompt_ids, seg.prompt_ids + seg.traj.token_ids + env_ids
                traj_len = seg.spent + len(seg.traj) + len(env_ids)
            else:
                env_ids = []
                prompt_ids = self._first_prompt(s, list(self.tok.encode(req.prompt, add_special_tokens=False)),
                                                param="prompt")
                ctx, traj_len = prompt_ids, _spent_before(s, prompt_ids)
            # the body's validation (the context: a 400) before the state's checks (staleness changes state)
            try:
                self._check_context(len(ctx), param="prompt")
                self._check_open(s)
                self._check_calls(s)
                self._check_staleness(s)
                max_tokens = self._max_tokens(len(ctx), traj_len, req.max_tokens, param="prompt")
            except ApiError as exc:
                _ends_truncated(s, exc)
                raise
            stop = self.stop_strings(s, req.stop)
            ids, lps, vers, finish = await self._generate(s, ctx, max_tokens, stop, on_token)
            if not stitched or seg is None:
                if s.segments:
                    s.stitch_mismatches += 1
                    self.counters["stitch_mismatches"] += 1
                    self.counters["segments_dropped"] += 1
                seg = Segment("completion", prompt_ids, Trajectory(index=s.index), spent=traj_len)
                s.segments.append(seg)
            else:
                seg.traj.add_environment(env_ids)
                self.counters["stitched_calls"] += 1
            seg.traj.add_policy(ids, lps, vers)
            seg.traj.num_turns += 1
            seg.traj.finish_reason = finish
            text = str(self.tok.decode(ids, skip_special_tokens=True))
            seg.text = req.prompt + text
            seg.last_text = text
            seg.calls += 1
            s.calls += 1
            self.counters["calls"] += 1
            shown = _cut_stop(text, stop) if finish is Finish.STOP else text
            seg.shown = req.prompt + shown
            return self._completion(s, "cmpl", req.model, shown, [], finish, ids, lps, len(ctx))

    def _first_prompt(self, s: SampleSession, ids: list[int], param: str = "messages") -> list[int]:
        """A sample's first prompt held to data.max_prompt_length as the in-process agent loop holds
        its prompt (truncated per data.truncation, or refused): unchecked, an agent's prompt of any
        length up to the engine's context became the group's prompt, past the sequence length the
        run was sized for. Later segments' prompts hold the turns so far; the response budget counts them."""
        limit = self.limits.max_prompt_length
        if s.segments or limit is None or len(ids) <= limit:
            return ids
        if self.limits.truncation == "error":
            raise ApiError(400, f"this sample's first prompt is {len(ids)} tokens (chat template and tools applied), "
                           f"over data.max_prompt_length={limit}; shorten it, or raise data.max_prompt_length or set "
                           "data.truncation=left|right|middle", param=param, code="context_length_exceeded")
        return truncate_prompt(ids, limit, self.limits.truncation, "")

    def _check_calls(self, s: SampleSession) -> None:
        if s.calls >= self.limits.max_calls_per_sample:
            raise ApiError(429, f"this sample made agent.max_calls_per_sample={self.limits.max_calls_per_sample} calls; "
                           "finish the session", code="too_many_calls")

    def _check_context(self, ctx_len: int, param: str = "messages") -> None:
        if self.limits.max_model_len - ctx_len < 1:
            raise ApiError(400, f"this call's prompt is {ctx_len} tokens; the model's context is "
                           f"{self.limits.max_model_len} tokens", param=param, code="context_length_exceeded")

    def _max_tokens(self, ctx_len: int, traj_len: int, requested: int | None, param: str = "messages") -> int:
        self._check_context(ctx_len, param)
        budget = self.limits.max_model_len - ctx_len
        left = self.limits.response_budget - traj_len
        if left < 1:
            raise ApiError(400, f"the sample's response budget (data.max_response_length="
                           f"{self.limits.response_budget} tokens after the first prompt: completions and everything "
                           "the agent added) is spent; finish the session", param=param,
                           code="context_length_exceeded")
        return min(requested or left, left, budget)

    def _decode_raw(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))

    async def _generate(self, s: SampleSession, ctx: list[int], max_tokens: int, stop: tuple[str, ...],
                        on_token: OnToken | None = None) -> tuple[list[int], list[float], list[int], Finish]:
        """One completion; a cut by a weight update (partial rollout, mode abort) is continued from
        everything so far (its new tokens carry the new version)."""
        g = s.group
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        for round_ in range(self.limits.max_resubmits + 1):
            left = max_tokens - len(ids)
            if left <= 0:
                return ids, lps, vers, Finish.LENGTH
            spec = SamplingSpec(n=1, temperature=g.spec.temperature, top_p=g.spec.top_p, top_k=g.spec.top_k,
                                max_tokens=left, stop=stop, seed=None)
            rid = f"{g.rid}/{s.index}/c{s.calls}-{uuid.uuid4().hex[:6]}" + (f"/r{round_}" if round_ else "")
            hook = None if on_token is None else (lambda _i, t, lp: on_token(t, lp))
            call = asyncio.ensure_future(g.generate(GenerationRequest(rid, ctx + ids, spec, on_token=hook)))
            g.generating.add(call)
            try:
                (out,) = await call
            except asyncio.CancelledError:
                if not call.cancelled() or _cancelling():
                    raise  # this handler itself was cancelled (a client gone, a shutdown)
                # the group ended and stopped the engine request
                raise ApiError(409, f"session {s.id} ended while this call was generating", code="session_closed") from None
            finally:
                g.generating.discard(call)
            boundary = len(ids)
            ids += out.token_ids
            lps += out.logprobs
            vers += out.versions
            cut = stop_across(self._decode_raw, ids, boundary, stop) if round_ else None
            if cut is not None:  # a stop string across the cut (the engine saw the continuation only)
                del ids[cut:], lps[cut:], vers[cut:]
                self._check_open(s)
                return ids, lps, vers, Finish.STOP
            if out.finish_reason is not Finish.ABORT:
                self._check_open(s)  # its group ended while it generated: answered as a call after the end
                return ids, lps, vers, out.finish_reason
            if s.state != "open":
                raise ApiError(409, f"session {s.id} ended while this call was generating", code="session_closed")
        # The session is open: told it ended (409), an agent stopped a sample its group still waited
        # for. Weight updates outran the call; a retry starts it afresh, so a retryable 503.
        raise ApiError(503, f"weight updates cut this call {self.limits.max_resubmits + 1} times (the call and "
                       f"async_training.max_resubmits={self.limits.max_resubmits} continuations) before it finished; "
                       "the session is open and nothing was recorded: retry the call, raise "
                       "async_training.max_resubmits, or set async_training.partial_rollout_mode=keep so a "
                       "weight update continues calls in flight",
                       code="resubmit_limit")

    def _completion(self, s: SampleSession, prefix: str, model: str, text: str, calls: Sequence[Any], finish: Finish,
                    ids: Sequence[int], lps: Sequence[float], prompt_tokens: int) -> Completion:
        reason = "length" if finish is Finish.LENGTH else ("tool_calls" if calls else "stop")
        return Completion(
            id=s.response_id(prefix), model=model or self.limits.model_name, text=text, tool_calls=list(calls),
            finish_reason=reason, token_texts=[str(self.tok.decode([t], skip_special_tokens=False)) for t in ids],
            logprobs=list(lps), prompt_tokens=prompt_tokens, completion_tokens=len(ids), created=now(),
        )


def _ends_truncated(s: SampleSession, exc: ApiError) -> None:
    """A call of an open sample refused because it leaves no room (the response budget or the
    model's context): nothing is recorded, and the sample's trajectory (its last segment) ends
    there truncated, with `length` as the in-process loop ends it (verl: what does not fit is not
    appended), not with the last turn's `stop` (the reward service is told `truncated`). A later
    call that fits replaces it."""
    if exc.code == "context_length_exceeded" and s.segments and s.state == "open":
        s.segments[-1].traj.finish_reason = Finish.LENGTH


def _spent_before(s: SampleSession, prompt_ids: Sequence[int]) -> int:
    """The budget a new segment starts with spent: the budget counts after the sample's first
    prompt (GatewayLimits.response_budget), and a segment whose prompt is longer holds turns the
    agent kept (their tokens open its response). Counted from 0 again, every call of an agent that
    keeps its own copy of the turns had the whole budget, and its response passed it by them all."""
    return max(0, len(prompt_ids) - len(s.segments[0].prompt_ids)) if s.segments else 0


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _template_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message as the chat template gets it: an assistant message the agent wrote itself with
    tool calls is rendered with hermes blocks in its content (what the policy would have written)."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m["role"] == "assistant" and m.get("tool_calls"):
        blocks = "".join(
            f'<tool_call>\n{{"name": {json.dumps(c["name"])}, "arguments": {c["arguments"] or "{}"}}}\n</tool_call>'
            for c in m["tool_calls"]
        )
        out["content"] = (out["content"] + "\n" if out["content"] else "") + blocks
    return out


def _cut_stop(text: str, stop: Sequence[str]) -> str:
    for s in stop:
        at = text.find(s)
        if at >= 0:
            text = text[:at]
    return text

