"""The hermes / Qwen3 tool-call format: an assistant turn holds zero or more

    <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>

blocks (whitespace around the JSON is allowed; `arguments` may also be a JSON string that holds an
object, as some models emit). Parsing never raises: a block that is not valid JSON, has no string
`name` (or one longer than MAX_NAME_CHARS), or whose arguments are not an object becomes a ToolCall
with `parse_error` set, which the environment answers with an error message (verl's behaviour) and
the rollout counts. A `<tool_call>` without its closing tag is such an error too.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.environment.base import ToolCall

START, END = "<tool_call>", "</tool_call>"
MAX_NAME_CHARS = 256
"""Longest tool name a call may carry. No tool has a longer one, and an environment server refuses
a Step whose call names pass its security.limits.max_name_chars (1024 by default) as a whole."""
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


def parse_tool_calls(text: str, turn: int = 0) -> tuple[str, list[ToolCall]]:
    """(the text without its tool-call blocks, the calls in order). Ids are `call_<turn>_<i>`."""
    calls: list[ToolCall] = []
    for i, m in enumerate(_BLOCK.finditer(text)):
        calls.append(_parse_one(m.group(1), f"call_{turn}_{i}"))
    content = _BLOCK.sub("", text)
    if START in content:  # opened, never closed (the policy stopped inside its call)
        raw = content[content.index(START) + len(START) :]
        calls.append(ToolCall(f"call_{turn}_{len(calls)}", "", raw.strip(), parse_error=f"{START} without {END}"))
        content = content[: content.index(START)]
    return content.strip(), calls


def _loads(text: str) -> tuple[Any, str | None]:
    """(the JSON value, None) or (None, why not). Model output is arbitrary text: besides malformed
    JSON, json.loads raises ValueError for an integer past Python's digit limit and RecursionError
    for nesting past the interpreter's depth."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at character {exc.pos}"
    except ValueError as exc:
        return None, str(exc)
    except RecursionError:
        return None, "nested deeper than the parser reads"


def _parse_one(raw: str, call_id: str) -> ToolCall:
    body = raw.strip()
    obj, error = _loads(body)
    if error is not None:
        return ToolCall(call_id, "", body, parse_error=f"invalid JSON ({error})")
    if not isinstance(obj, dict):
        return ToolCall(call_id, "", body, parse_error=f"expected a JSON object with name and arguments, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(call_id, "", body, parse_error='no "name" (a non-empty string)')
    if len(name) > MAX_NAME_CHARS:
        return ToolCall(call_id, "", body, parse_error=f'"name" is {len(name)} characters long; a tool name has at most {MAX_NAME_CHARS}')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        args, error = _loads(args) if args.strip() else ({}, None)
        if error is not None:
            return ToolCall(call_id, name, obj["arguments"], parse_error=f"arguments are not valid JSON ({error})")
    if not isinstance(args, dict):
        return ToolCall(call_id, name, json.dumps(args), parse_error=f'"arguments" must be an object, got {type(args).__name__}')
    try:
        return ToolCall(call_id, name, json.dumps(args, ensure_ascii=False, separators=(",", ":")))
    except RecursionError:  # loads reached a depth that dumps does not
        return ToolCall(call_id, name, "", parse_error="arguments nest deeper than the parser writes")
