"""`stream: true`, token by token: server-sent events that leave as the engine samples.

    engine thread ─ on_token(id, logprob) ─► queue ─► events():  decode ids so far, emit the part
                   (call_soon_threadsafe)                        that the final content must start
                                                                 with, with those tokens' logprobs
    the call returns (recorded, parsed) ─► the rest of the content, delta.tool_calls, the finish
                                          reason, usage (stream_options.include_usage), [DONE]

What is held back until the call ends, so that the streamed content is exactly the content a
non-streamed call returns: text from a `<tool_call>` on (the block is parsed at the end and sent as
`delta.tool_calls`, OpenAI's streaming schema) and a partial marker at the end, leading and trailing
whitespace when tools are on (the parsed content is stripped), a possible stop string's start (the
content is cut at it), trailing whitespace and an incomplete character (a decode of a prefix can
differ there). Logprobs go out with the chunk of their tokens, so the chunks' tokens are the
recorded completion, token for token.

Errors before the first token (the session's state, staleness, an over-long prompt) answer with
their HTTP status as without streaming; one after it is an SSE `{"error": ...}` event (the SDKs
raise it). A client that disconnects mid-stream does not stop the call: it is recorded, as a
non-streamed call whose client went away.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from services.common.logging import get_logger

from ..agent.parser import START
from .openai_api import ApiError, Completion, _tool_call_json, chat_chunks, completion_chunks, completion_logprobs, sse
from .sessions import OnToken

log = get_logger(__name__)

_Item = tuple[int, float] | None


@dataclass(frozen=True)
class StreamSpec:
    kind: Literal["chat", "completion"]
    id: str
    model: str
    created: int
    tools: bool
    stop: tuple[str, ...]
    logprobs: bool
    include_usage: bool


def safe_text(raw: str, *, tools: bool, stop: Sequence[str]) -> str:
    """The prefix of `raw` (the completion decoded so far) that the call's final content starts
    with whatever tokens follow."""
    text = raw.rstrip("\ufffd")  # an incomplete multi-byte character
    found = [at for at in (text.find(s) for s in stop) if at >= 0]
    if found:  # the engine stops at a match: no more tokens come
        text = text[: min(found)]
    elif stop:  # the end may be a stop string's start
        text = text[: max(0, len(text) - (max(len(s) for s in stop) - 1))]
    if tools:
        at = text.find(START)
        if at >= 0:
            text = text[:at]
        else:
            for k in range(min(len(START) - 1, len(text)), 0, -1):
                if text.endswith(START[:k]):
                    text = text[:-k]
                    break
        text = text.lstrip()
    return text.rstrip()


async def open_stream(call: Callable[[OnToken], Coroutine[Any, Any, Completion]], spec: StreamSpec, tok: Any,
                      counters: dict[str, int]) -> AsyncIterator[bytes]:
    """Start the call; return its events once the first token is out. Raises what the call raises
    before that (so the response carries its status)."""
    q: asyncio.Queue[_Item] = asyncio.Queue()
    task = asyncio.get_running_loop().create_task(call(lambda t, lp: q.put_nowait((t, lp))))

    def ended(t: asyncio.Task[Completion]) -> None:
        q.put_nowait(None)
        if not t.cancelled():
            t.exception()  # retrieved here too: a client may have gone before the end

    task.add_done_callback(ended)
    first = await q.get()
    if first is None:  # nothing streamed: an error, or an engine that does not stream
        c = task.result()
        events = chat_chunks(c, spec.logprobs, spec.include_usage) if spec.kind == "chat" else \
            completion_chunks(c, spec.logprobs, spec.include_usage)
        return _aiter(sse(events))
    return _events(first, q, task, spec, tok, counters)


async def _aiter(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


def _data(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


async def _events(first: _Item, q: asyncio.Queue[_Item], task: asyncio.Task[Completion], spec: StreamSpec, tok: Any,
                  counters: dict[str, int]) -> AsyncIterator[bytes]:
    chat = spec.kind == "chat"
    base = {"id": spec.id, "object": "chat.completion.chunk" if chat else "text_completion", "created": spec.created,
            "model": spec.model}

    def chunk(delta: dict[str, Any] | str, finish: str | None = None, lp: Any = None) -> dict[str, Any]:
        choice = ({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp} if chat else
                  {"index": 0, "text": delta, "finish_reason": finish, "logprobs": lp})
        out: dict[str, Any] = {**base, "choices": [choice]}
        if spec.include_usage:
            out["usage"] = None
        return out

    def content(text: str, lp: Any = None) -> dict[str, Any]:
        return chunk({"content": text} if chat else text, lp=lp)

    if chat:
        yield _data(chunk({"role": "assistant", "content": ""}))
    ids: list[int] = []
    emitted = ""
    offset = 0  # text completions: where the next token's text starts (each token decoded alone)
    item, done = first, False
    while not done:
        batch = [item]
        while not q.empty():
            batch.append(q.get_nowait())
        new = [b for b in batch if b is not None]
        done = len(new) < len(batch)
        if new:
            ids += [t for t, _ in new]
            safe = safe_text(str(tok.decode(ids, skip_special_tokens=True)), tools=spec.tools, stop=spec.stop)
            delta = safe[len(emitted):] if len(safe) > len(emitted) and safe.startswith(emitted) else ""
            emitted += delta
            lp = None
            if spec.logprobs:
                texts, lps = _texts(tok, [t for t, _ in new]), [x for _, x in new]
                if chat:
                    lp = {"content": [{"token": s, "logprob": x, "bytes": list(s.encode()), "top_logprobs": []}
                                      for s, x in zip(texts, lps, strict=True)]}
                else:
                    lp = completion_logprobs(texts, lps, offset)
                    offset += sum(len(s) for s in texts)
            if delta or lp is not None:
                yield _data(content(delta, lp))
        if not done:
            item = await q.get()
    try:
        c = task.result()
    except ApiError as exc:
        yield _data(exc.body())
        return
    except Exception as exc:  # after the headers, an error can only be an event
        log.error("gateway_stream_error", error=repr(exc)[:500], exc_info=exc)
        yield _data(ApiError(500, f"internal error in the gateway: {type(exc).__name__}").body())
        return
    if c.text.startswith(emitted):
        rest = c.text[len(emitted):]
    else:  # e.g. a tool block that did not parse is shown raw, with the whitespace the stream held
        counters["stream_content_diverged"] = counters.get("stream_content_diverged", 0) + 1
        log.warning("gateway_stream_diverged", streamed=emitted[:80], content=c.text[:80])
        shown = c.text.lstrip()
        rest = shown[len(emitted):] if shown.startswith(emitted) else ""
    if rest:
        yield _data(content(rest))
    if c.tool_calls:
        yield _data(chunk({"tool_calls": [{"index": k, **tc} for k, tc in enumerate(_tool_call_json(c.tool_calls))]}))
    yield _data(chunk({} if chat else "", c.finish_reason))
    if spec.include_usage:
        yield _data({**base, "choices": [], "usage": c.usage()})
    yield b"data: [DONE]\n\n"


def _texts(tok: Any, ids: list[int]) -> list[str]:
    return [str(tok.decode([t], skip_special_tokens=False)) for t in ids]
