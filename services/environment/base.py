"""The environment contract in Python: value types and the `Environment` class every environment
implements, in-process (built-ins, verl tools) or behind gRPC (services/environment/client.py
speaks meshrl.v1.EnvironmentService with exactly this shape).

One session per trajectory:

    start(session_id, prompt)                       -> StartResult(messages, tools, max_turns)
    step(session_id, turn=0, assistant_text, calls) -> StepResult(messages, done, reward, metrics)
    step(session_id, turn=1, ...)                   ...
    close(session_id)                               -> CloseResult(reward, metrics)

Contract (what the rollout relies on):
- `step` is called with turns 0, 1, 2, ... in order, once each, after `start`; `close` once at the
  end (also after a failure or an abort, so resources are released).
- A step's messages have role `tool` (one per answered tool call, in call order) or `user`.
- A malformed or unknown tool call is answered with an error text as the tool's response and
  counted in `tool_errors`, never raised (verl's behaviour).
- Raise a MeshError for trouble: Unavailable (temporary) or InvalidArgument (the request cannot
  be served). Either fails the trajectory's group: its prompt is re-queued and the error reported
  to the coordinator (which halts the run on coordinator.max_consecutive_failures in a row); the
  rollout replica goes on.
- Rewards are finite numbers (one that is not fails the group like an error).
- Sessions of one environment object run concurrently on one event loop: keep per-session state
  keyed by session_id.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = ("tool", "user")
"""Roles an environment may append."""


@dataclass(frozen=True)
class Message:
    """One chat message."""

    role: str
    content: str
    error: bool = False
    """A tool call answered with an error text (unknown tool, bad arguments, a tool that raised):
    the rollout shows it whole, as verl does, where it cuts a tool's own response to
    `max_tool_response_length`. On the wire: `ChatMessage.error` (an environment that does not set
    it has its error texts cut like its other tool responses)."""

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from an assistant turn (hermes `<tool_call>` JSON)."""

    id: str
    name: str
    arguments_json: str
    parse_error: str = ""
    """Non-empty when the call could not be parsed; answer it with an error text."""

    def arguments(self) -> dict[str, Any]:
        """The arguments as a dict; ValueError when they are not a JSON object."""
        try:
            value = json.loads(self.arguments_json) if self.arguments_json else {}
        except RecursionError:  # a sampled call can nest deeper than the parser reads
            raise ValueError("arguments nest deeper than the JSON parser reads") from None
        if not isinstance(value, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(value).__name__}")
        return value


@dataclass(frozen=True)
class EnvPrompt:
    """The leased prompt as an environment sees it."""

    prompt_id: str = ""
    data_source: str = ""
    messages: tuple[Message, ...] = ()
    text: str = ""
    ground_truth: str = ""
    extra_info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StartResult:
    messages: tuple[Message, ...] = ()
    """Conversation to start from; empty: the prompt's own messages."""
    tools: tuple[Mapping[str, Any], ...] = ()
    """OpenAI function tools ({"type": "function", "function": {...}}) for the chat template."""
    max_turns: int = 0
    """Most assistant turns the episode allows; 0: no limit of the environment's own."""


@dataclass(frozen=True)
class StepResult:
    messages: tuple[Message, ...] = ()
    done: bool = False
    reward: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    tool_errors: int = 0


@dataclass(frozen=True)
class CloseResult:
    reward: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)


class Environment(ABC):
    """One environment (see the module docstring for the contract)."""

    name: str = "environment"

    @abstractmethod
    async def start(self, session_id: str, prompt: EnvPrompt, *, sample_index: int = 0, policy_version: int = 0) -> StartResult:
        """Open a session for one trajectory of `prompt`."""

    @abstractmethod
    async def step(
        self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *, policy_version: int = 0
    ) -> StepResult:
        """Answer assistant turn `turn` (0-based)."""

    @abstractmethod
    async def close(self, session_id: str) -> CloseResult:
        """End the session; idempotent."""

    async def aclose(self) -> None:
        """Release what the environment object holds (channels, pools). Default: nothing."""
        return None

    def status(self) -> dict[str, Any]:
        """Numbers for status calls and metrics."""
        return {"name": self.name}
