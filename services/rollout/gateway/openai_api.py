"""OpenAI's wire schema for the gateway: request bodies in (validated, the field named in every
error), response bodies out (chat.completion, chat.completion.chunk, text_completion, the error
object). No FastAPI here: app.py turns ApiError into an HTTP response and these dicts into JSON.

Sampling: `temperature` and `top_p` are validated and then ignored: the run's
`actor_rollout_ref.rollout.temperature` / `top_p` sample every call, because the trainer
recomputes logprobs under the run's temperature (a call sampled under another one would be
trained as if it were not). `max_tokens` / `max_completion_tokens` and `stop` are honoured within
the sample's budget (a call stops at the request's stop strings and at the run's). `n` must be 1
(a session is one sample). `top_logprobs` must be 0: engines report the sampled token's logprob
only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.environment.base import ToolCall


class ApiError(Exception):
    """An error the client sees as HTTP `status` with OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "api_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """OpenAI's SDKs retry 409 and 429 by default; here both are the sample's state (ended,
        too stale, out of calls) and a retry gets the same answer after seconds of backoff, so
        `x-should-retry: false`, which the SDKs honour."""
        return {"x-should-retry": "false"} if self.status == 409 or self.code == "too_many_calls" else {}


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: str
    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool
    stream: bool
    include_usage: bool
    model: str


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool
    stream: bool
    include_usage: bool
    model: str


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _text(content: Any, field: str) -> str:
    """Message content as text: a string, null, or a list of {type: text, text} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{field}[{j}]", "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
            out.append(part["text"])
        return "".join(out)
    raise bad(field, f"must be a string, null or a list of text parts, got {type(content).__name__}")


def _tool_calls(raw: Any, field: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad(field, "must be a list")
    calls = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise bad(f"{field}[{j}].function", "must be an object with a string name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise bad(f"{field}[{j}].function.arguments", "must be a JSON string")
        calls.append({"id": str(c.get("id", "")), "name": fn["name"], "arguments": args})
    return calls


def normalize_messages(raw: Any) -> list[dict[str, Any]]:
    """The request's messages as plain dicts: role, content (text), and tool_calls / tool_call_id
    where present. Raises ApiError(400) naming the offending field."""
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(raw):
        field = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise bad(field, "must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # a list or object is unhashable: a 500 otherwise
            raise bad(f"{field}.role", f"must be one of {sorted(_ROLES)}, got {role!r}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _text(m.get("content"), f"{field}.content")}
        if role == "assistant":
            calls = _tool_calls(m.get("tool_calls"), f"{field}.tool_calls")
            if calls:
                msg["tool_calls"] = calls
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        out.append(msg)
    return out


def _opt_int(body: Mapping[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad(key, f"must be an integer >= {lo}, got {v!r}")
    return v


def _opt_number(body: Mapping[str, Any], key: str, lo: float, hi: float) -> None:
    v = body.get(key)
    if v is None:
        return
    # the range alone rejects NaN and infinities (math.isfinite would overflow on an int past a float's range)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad(key, f"must be a number in [{lo}, {hi}], got {v!r}")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or len(items) > 4 or not all(isinstance(s, str) and s for s in items):
        raise bad("stop", "must be a non-empty string or a list of at most 4 non-empty strings")
    return tuple(items)


def _common(body: Any) -> tuple[Mapping[str, Any], int | None, tuple[str, ...], bool, bool, str]:
    if not isinstance(body, Mapping):
        raise bad("body", "must be a JSON object")
    # OpenAI's schema makes these nullable: null is absent (clients that serialize every field send it)
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("n", f"must be 1 (one session is one sample; meshrl runs rollout.n sessions per prompt), got {n!r}")
    _opt_number(body, "temperature", 0.0, 2.0)
    _opt_number(body, "top_p", 0.0, 1.0)
    mt = _opt_int(body, "max_completion_tokens", 1)
    max_tokens = mt if mt is not None else _opt_int(body, "max_tokens", 1)
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise bad("stream", "must be a boolean")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, Mapping):
        raise bad("stream_options", "must be an object")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise bad("model", "must be a string")
    return body, max_tokens, _stop(body), stream, bool(opts.get("include_usage", False)), model


def parse_chat(body: Any) -> ChatRequest:
    body, max_tokens, stop, stream, include_usage, model = _common(body)
    messages = normalize_messages(body.get("messages"))
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(
        isinstance(t, Mapping) and t.get("type") == "function" and isinstance(t.get("function"), Mapping)
        and isinstance(t["function"].get("name"), str) for t in tools
    ):
        raise bad("tools", 'must be a list of {"type": "function", "function": {"name", "description", "parameters"}}')
    choice = body.get("tool_choice")
    if choice is None:  # nullable in OpenAI's schema: null is absent
        choice = "auto"
    if choice not in ("auto", "none"):
        raise bad("tool_choice", f"only 'auto' and 'none' are supported (the policy decides; nothing forces a call), got {choice!r}")
    logprobs = False if body.get("logprobs") is None else body["logprobs"]
    if not isinstance(logprobs, bool):
        raise bad("logprobs", "must be a boolean")
    if body.get("top_logprobs") not in (None, 0):
        raise bad("top_logprobs", "must be 0 or absent: the rollout engine reports only the sampled token's logprob")
    return ChatRequest(messages, [dict(t) for t in tools], choice, max_tokens, stop, logprobs, stream, include_usage,
                       model)


def parse_completion(body: Any) -> CompletionRequest:
    body, max_tokens, stop, stream, include_usage, model = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt", "must be a non-empty string (or a list of exactly one)")
    lp = body.get("logprobs")
    if lp not in (None, 0, 1) or isinstance(lp, bool):
        raise bad("logprobs", "must be null, 0 or 1: the rollout engine reports only the sampled token's logprob")
    if body.get("echo"):
        raise bad("echo", "is not supported")
    # 0 asks for no alternatives, yet the sampled tokens' logprobs come back (OpenAI, vLLM)
    return CompletionRequest(prompt, max_tokens, stop, lp is not None, stream, include_usage, model)


# ---- responses ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """One call's answer, engine-side: what the responses below are built from."""

    id: str
    model: str
    text: str
    """The content the client sees (tool-call blocks removed when they parsed, a stop string cut)."""
    tool_calls: Sequence[ToolCall]
    finish_reason: str
    token_texts: Sequence[str]
    logprobs: Sequence[float]
    prompt_tokens: int
    completion_tokens: int
    created: int

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def now() -> int:
    return int(time.time())


def _tool_call_json(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]


def _chat_logprobs(c: Completion) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(c.token_texts, c.logprobs, strict=True)]}


def chat_response(c: Completion, logprobs: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None}
    if c.tool_calls:
        message["tool_calls"] = _tool_call_json(c.tool_calls)
    return {
        "id": c.id, "object": "chat.completion", "created": c.created, "model": c.model,
        "choices": [{"index": 0, "message": message, "finish_reason": c.finish_reason,
                     "logprobs": _chat_logprobs(c) if logprobs else None}],
        "usage": c.usage(),
    }


def chat_chunks(c: Completion, logprobs: bool, include_usage: bool) -> list[dict[str, Any]]:
    """A whole completion as chat.completion.chunk events (streaming.py's path when the engine
    streamed no token, e.g. vLLM): the role, the content (one chunk: the completion exists whole
    when streaming starts, and one chunk carries every token's logprob
    even where token texts do not add up to the content, e.g. an end-of-turn token), the tool
    calls, the finish reason, then (stream_options.include_usage) the usage."""
    base = {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model}

    def chunk(delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> dict[str, Any]:
        out = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}]}
        if include_usage:
            out["usage"] = None
        return out

    chunks = [chunk({"role": "assistant", "content": ""})]
    if c.text or logprobs:
        chunks.append(chunk({"content": c.text}, lp=_chat_logprobs(c) if logprobs else None))
    if c.tool_calls:
        chunks.append(chunk({"tool_calls": [{"index": k, **tc} for k, tc in enumerate(_tool_call_json(c.tool_calls))]}))
    chunks.append(chunk({}, c.finish_reason))
    if include_usage:
        chunks.append({**base, "choices": [], "usage": c.usage()})
    return chunks


def completion_logprobs(texts: Sequence[str], logprobs: Sequence[float], offset: int = 0) -> dict[str, Any]:
    """A text completion's `logprobs` object for tokens `texts` (each decoded alone) whose first
    starts at character `offset` of the completion."""
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": list(texts), "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def completion_response(c: Completion, logprobs: bool) -> dict[str, Any]:
    lp = completion_logprobs(c.token_texts, c.logprobs) if logprobs else None
    return {
        "id": c.id, "object": "text_completion", "created": c.created, "model": c.model,
        "choices": [{"index": 0, "text": c.text, "finish_reason": c.finish_reason, "logprobs": lp}],
        "usage": c.usage(),
    }


def completion_chunks(c: Completion, logprobs: bool, include_usage: bool) -> list[dict[str, Any]]:
    base = {"id": c.id, "object": "text_completion", "created": c.created, "model": c.model}
    lp = completion_logprobs(c.token_texts, c.logprobs) if logprobs else None
    out: list[dict[str, Any]] = [{**base, "choices": [{"index": 0, "text": c.text, "finish_reason": None, "logprobs": lp}]},
                                 {**base, "choices": [{"index": 0, "text": "", "finish_reason": c.finish_reason,
                                                       "logprobs": None}]}]
    if include_usage:
        out.append({**base, "choices": [], "usage": c.usage()})
    return out


def models_response(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "meshrl"}]}


def sse(events: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """Server-sent events, ending with OpenAI's `data: [DONE]`."""
    return [f"data: {json.dumps(e, separators=(',', ':'))}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
