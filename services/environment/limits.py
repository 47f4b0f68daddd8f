"""Bounds on what crosses the environment boundary, shared by the rollout (which cuts each tool
response to `max_tool_response_length` before the policy reads it) and `meshrl environment serve` (which
cuts a Step's answer to `environment.max_message_chars` so it always fits a gRPC message).

Why the server cuts in the middle: the rollout cuts again, on its configured side
(`tool_response_truncate_side`), to `max_tool_response_length`, normally far shorter. A middle cut
keeps both ends, so that second cut reads the same characters, on any side, as it would have read
from the whole message; the policy sees what the in-process environment would have shown it. An
error text (`Message.error`, carried as `ChatMessage.error`) the rollout shows whole: the server's
cut, which keeps the mark, is its only one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from .base import Message, ToolCall

TruncateSide = Literal["left", "middle", "right"]


def truncate_text(text: str, limit: int, side: TruncateSide) -> tuple[str, bool]:
    """verl's truncation of a long tool response (ToolAgentLoop, character for character): keep
    `limit` characters of its start (left) or end (right), or `limit // 2` of each end (middle:
    one fewer than `limit` when it is odd, as verl keeps), marked."""
    if len(text) <= limit:
        return text, False
    if side == "left":
        return text[:limit] + "...(truncated)", True
    if side == "right":
        return "(truncated)..." + text[-limit:], True
    half = limit // 2  # verl's text[-half:] is the whole text at half 0; nothing is kept of either end here
    return text[:half] + "...(truncated)..." + text[len(text) - half :], True


def _fair_cap(lengths: Sequence[int], budget: int) -> int | None:
    """The largest per-message length c with sum(min(n, c)) <= budget (short messages are kept
    whole, the long ones share what is left equally); None when everything fits."""
    if sum(lengths) <= budget:
        return None
    left = budget
    ordered = sorted(lengths)
    for i, n in enumerate(ordered):
        share = left // (len(ordered) - i)
        if n > share:
            return share
        left -= n
    return None  # unreachable: the sum exceeds the budget, so some message exceeds its share


def bound_messages(messages: Sequence[Message], budget_chars: int) -> tuple[tuple[Message, ...], int]:
    """(the messages with at most `budget_chars` characters of content in all, how many were
    cut). A cut message keeps both ends and says so ("...(truncated)..."), and its role and
    `error` mark: an error text past the budget is cut like any other, still shown as an error."""
    cap = _fair_cap([len(m.content) for m in messages], budget_chars)
    if cap is None:
        return tuple(messages), 0
    out, cut = [], 0
    for m in messages:
        content, was_cut = truncate_text(m.content, cap, "middle")
        cut += was_cut
        out.append(dataclasses.replace(m, content=content) if was_cut else m)
    return tuple(out), cut


def split_calls(calls: Sequence[ToolCall], max_calls: int) -> tuple[list[ToolCall], list[Message]]:
    """(the first `max_calls` calls, to run; an error answer for each call past them). A policy
    that writes more calls than a server takes gets tool errors and its episode goes on, as the
    in-process environment answers calls past `max_parallel_calls`."""
    run, extra = list(calls[:max_calls]), calls[max_calls:]
    error = (f"Error: more than {max_calls} tool calls in one turn; this call was not run "
             f"(environment.max_tool_calls={max_calls})")
    return run, [Message("tool", error, error=True) for _ in extra]
