"""`agent.*`: black-box agents trained through meshrl's OpenAI-compatible gateway.

With `agent.command` (or `agent.endpoint`) set, every rollout replica serves the gateway
(services/rollout/gateway) and plays each leased prompt by starting the agent once per sample:
the agent talks to the policy only through `OPENAI_BASE_URL` with `OPENAI_API_KEY`, and every
call it makes becomes that sample's training data."""

from __future__ import annotations

import os

from pydantic import Field, field_validator, model_validator

from .base import ConfigModel


class AgentConfig(ConfigModel):
    """How agents are started and how the gateway they call is served."""

    command: list[str] | None = None
    """A program started once per sample (argv, no shell) with OPENAI_BASE_URL, OPENAI_API_KEY and
    MESHRL_SESSION_ID in its environment and the prompt as JSON on stdin; it ends its sample with
    `POST $OPENAI_BASE_URL/../finish` (or by exiting 0: then the reward service scores its last
    answer). `python` / `python3` as the program is the rollout replica's own interpreter; an
    argument that is a relative path to an existing file here is made absolute (replicas run in
    other working directories). Null: no command."""
    endpoint: str | None = None
    """An HTTP service meshrl POSTs {prompt, base_url, api_key, session_id} to, once per sample,
    instead of starting `command`; it runs the agent and finishes the session. Null: none."""
    host: str = "127.0.0.1"
    """Interface the gateway binds on each rollout replica (loopback: agents run on the same node)."""
    port: int = Field(default=0, ge=0, le=65535)
    """Gateway port (0: any free one; each replica picks its own)."""
    advertise_host: str | None = None
    """Host agents are told to call (the base URL); null: `host`, or the node's IP when `host` is
    0.0.0.0."""
    max_concurrent: int = Field(default=8, ge=1)
    """Agents running at once per rollout replica (the others wait for a slot)."""
    sample_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of one sample, from its agent's start: past it the agent is stopped and the group's
    lease returned (its prompt is re-queued, never scored as zero)."""
    max_calls_per_sample: int = Field(default=64, ge=1)
    """Model calls one sample may make; more are refused (HTTP 429)."""
    max_request_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Largest request body the gateway reads (HTTP 413 beyond)."""

    @property
    def enabled(self) -> bool:
        return self.command is not None or self.endpoint is not None

    @field_validator("command")
    @classmethod
    def _absolute_paths(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        return [os.path.abspath(a) if a and not os.path.isabs(a) and os.path.isfile(a) else a for a in value]

    @model_validator(mode="after")
    def _one_launcher(self) -> AgentConfig:
        if self.command is not None and self.endpoint is not None:
            raise ValueError("set one of agent.command and agent.endpoint, not both")
        if self.command is not None and not self.command:
            raise ValueError("agent.command is empty; give the program and its arguments, e.g. [python, my_agent.py]")
        return self
