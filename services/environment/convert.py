"""Proto <-> Python for the environment service (the only module that knows both), with the
validation of requests (errors name the field: `tool_calls[2].arguments_json`) and of replies
from an external endpoint (errors name the endpoint)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

from meshrl.v1 import common_pb2, environment_pb2
from services.common.errors import BadReply, InvalidArgument
from services.common.jsonutil import DEFAULT_MAX_DEPTH, loads, loads_object

from .base import ROLES, CloseResult, EnvPrompt, Message, StartResult, StepResult, ToolCall

MAX_ID_CHARS = 256


def require_session_id(value: str, field: str = "session_id") -> str:
    if not value:
        raise InvalidArgument(field, "must be non-empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(field, f"longer than {MAX_ID_CHARS} characters")
    return value


def prompt_from_proto(p: common_pb2.Prompt, field: str = "prompt", *, max_depth: int = DEFAULT_MAX_DEPTH) -> EnvPrompt:
    """MAX_DEPTH bounds extra_info's nesting: the mesh's `security.limits.max_json_depth`, as the
    reward service bounds the same field."""
    return EnvPrompt(
        prompt_id=p.prompt_id, data_source=p.data_source,
        messages=tuple(Message(m.role, m.content) for m in p.messages), text=p.text, ground_truth=p.ground_truth,
        extra_info=loads_object(p.extra_info_json, f"{field}.extra_info_json", max_depth=max_depth),
    )


def prompt_to_proto(p: EnvPrompt) -> common_pb2.Prompt:
    out = common_pb2.Prompt(prompt_id=p.prompt_id, data_source=p.data_source, text=p.text, ground_truth=p.ground_truth)
    for m in p.messages:
        out.messages.add(role=m.role, content=m.content)
    if p.extra_info:
        out.extra_info_json = json.dumps(dict(p.extra_info), separators=(",", ":"))
    return out


def tool_call_to_proto(c: ToolCall) -> environment_pb2.ToolCall:
    return environment_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json, parse_error=c.parse_error)


def tool_calls_from_request(req: environment_pb2.StepRequest) -> list[ToolCall]:
    """The calls of a Step, their ids checked (the client's fault). How many there are and how long
    the text is are the sampled turn's, not errors: the session table bounds them (core.py)."""
    seen: set[str] = set()
    out = []
    for i, c in enumerate(req.tool_calls):
        if not c.id:
            raise InvalidArgument(f"tool_calls[{i}].id", "must be non-empty")
        if c.id in seen:
            raise InvalidArgument(f"tool_calls[{i}].id", f"{c.id!r} repeats an earlier call's id")
        seen.add(c.id)
        out.append(ToolCall(c.id, c.name, c.arguments_json, c.parse_error))
    return out


def _messages(msgs: Sequence[Message]) -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(role=m.role, content=m.content, error=m.error) for m in msgs]


def start_response(session_id: str, r: StartResult) -> environment_pb2.StartResponse:
    return environment_pb2.StartResponse(
        session_id=session_id, messages=_messages(r.messages),
        tools_json=[json.dumps(dict(t), separators=(",", ":")) for t in r.tools], max_turns=r.max_turns,
    )


def step_response(session_id: str, turn: int, r: StepResult) -> environment_pb2.StepResponse:
    out = environment_pb2.StepResponse(
        session_id=session_id, turn=turn, messages=_messages(r.messages), done=r.done, metrics=dict(r.metrics),
        tool_errors=r.tool_errors,
    )
    if r.reward is not None:
        out.reward = r.reward
    return out


def close_response(r: CloseResult) -> environment_pb2.CloseResponse:
    out = environment_pb2.CloseResponse(metrics=dict(r.metrics))
    if r.reward is not None:
        out.reward = r.reward
    return out


# ---- replies of an external endpoint ---------------------------------------------------------------


def _check_metrics(metrics: Mapping[str, float], source: str, where: str) -> dict[str, float]:
    for k, v in metrics.items():
        if not math.isfinite(v):
            raise BadReply(source, f"{where}.metrics[{k!r}] is not finite ({v})")
    return dict(metrics)


def _check_messages(msgs: Sequence[common_pb2.ChatMessage], source: str, where: str, roles: Sequence[str]) -> tuple[Message, ...]:
    out = []
    for i, m in enumerate(msgs):
        if m.role not in roles:
            raise BadReply(source, f"{where}.messages[{i}].role is {m.role!r}; an environment may send {list(roles)}")
        out.append(Message(m.role, m.content, error=m.error))
    return tuple(out)


def start_from_reply(resp: environment_pb2.StartResponse, session_id: str, source: str) -> StartResult:
    if resp.session_id != session_id:
        raise BadReply(source, f"StartResponse.session_id is {resp.session_id!r}, expected {session_id!r}")
    tools = []
    for i, text in enumerate(resp.tools_json):
        try:  # bounded as every other JSON field (a deep document raised a bare RecursionError)
            tool = loads(text, f"StartResponse.tools_json[{i}]")
        except InvalidArgument as exc:
            raise BadReply(source, str(exc)) from None
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict) or not tool["function"].get("name"):
            raise BadReply(source, f"StartResponse.tools_json[{i}] is not an OpenAI function tool "
                                          '({"type": "function", "function": {"name": ...}})')
        tools.append(tool)
    msgs = _check_messages(resp.messages, source, "StartResponse", ("system", "user", "assistant", "tool"))
    return StartResult(messages=msgs, tools=tuple(tools), max_turns=resp.max_turns)


def step_from_reply(resp: environment_pb2.StepResponse, session_id: str, turn: int, source: str) -> StepResult:
    if resp.session_id != session_id or resp.turn != turn:
        raise BadReply(
            source, f"StepResponse is for ({resp.session_id!r}, turn {resp.turn}), expected ({session_id!r}, turn {turn})"
        )
    reward = resp.reward if resp.HasField("reward") else None
    if reward is not None and not math.isfinite(reward):
        raise BadReply(source, f"StepResponse.reward is not finite ({reward})")
    return StepResult(
        messages=_check_messages(resp.messages, source, "StepResponse", ROLES), done=resp.done, reward=reward,
        metrics=_check_metrics(resp.metrics, source, "StepResponse"), tool_errors=resp.tool_errors,
    )


def close_from_reply(resp: environment_pb2.CloseResponse, source: str) -> CloseResult:
    reward = resp.reward if resp.HasField("reward") else None
    if reward is not None and not math.isfinite(reward):
        raise BadReply(source, f"CloseResponse.reward is not finite ({reward})")
    return CloseResult(reward=reward, metrics=_check_metrics(resp.metrics, source, "CloseResponse"))
