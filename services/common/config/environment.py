"""`environment.*`: external environments (EnvironmentService endpoints), how an environment's
reward combines with the reward service's, and the plain server of `meshrl environment serve`.
The multi-turn loop's own knobs are verl's `actor_rollout_ref.rollout.multi_turn.*`."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .base import ConfigModel
from .endpoint import EndpointConfig, check_routing


class EnvironmentEndpointConfig(EndpointConfig):
    """An external meshrl.v1.EnvironmentService, routed by data_source like reward.endpoints.

    A trajectory waits for its environment at most `max_wait_s` (finite by default, unlike a
    reward endpoint's): then the trajectory's lease is returned and its prompt re-queued
    (counted), never scored as zero."""

    kind: ClassVar[str] = "environment endpoint"

    max_wait_s: float | None = Field(default=60.0, gt=0)
    """How long a call may wait for this endpoint to come back before the trajectory gives its
    prompt back; null: wait until it returns."""


class EnvironmentConfig(ConfigModel):
    """Environments of multi-turn trajectories.

    Routing of a prompt by its data_source: an endpoint that lists it, else the in-process tool
    environment (`actor_rollout_ref.rollout.multi_turn.tool_config_path` /
    `interaction_config_path`; no tools: the episode ends after the first assistant turn), else
    the catch-all endpoint (empty `data_sources`)."""

    endpoints: list[EnvironmentEndpointConfig] = []
    """External environment services."""
    reward_source: Literal["reward_service", "environment", "sum"] = "reward_service"
    """A trajectory's reward: the reward service's score of the final answer (the environment's
    rewards reach it as extra_info["rollout_reward_scores"], as in verl), the environment's own
    reward (the sum of its step and close rewards; an environment that gives none is an error),
    or their sum."""
    host: str = "127.0.0.1"
    """`meshrl environment serve`: interface to bind."""
    port: int = Field(default=50081, ge=0, le=65535)
    """`meshrl environment serve`: port (0: any free one)."""
    token: str | None = None
    """`meshrl environment serve`: bearer token every call must carry (role rollout); null: the
    MESHRL_ENVIRONMENT_TOKEN environment variable, else the mesh's role tokens (MESHRL_ROLLOUT_TOKEN
    ...), else none (a server bound beyond loopback warns)."""
    tls_cert_file: str | None = None
    """`meshrl environment serve`: PEM certificate chain (TLS with `tls_key_file`)."""
    tls_key_file: str | None = None
    """`meshrl environment serve`: PEM private key."""
    max_sessions: int = Field(default=4096, ge=1)
    """Open sessions a server holds at most (Start beyond it: RESOURCE_EXHAUSTED)."""
    session_ttl_s: float = Field(default=900.0, gt=0)
    """A session without a call for this long is closed by the server (a rollout that died)."""
    close_wait_s: float = Field(default=30.0, gt=0)
    """A Close (or the expiry) waits this long at most for the session's calls still running (a
    hung tool), then cancels them and closes the session."""
    max_message_chars: int = Field(default=1 << 20, ge=1, le=8 << 20)
    """A Step's assistant text past this many characters is cut (in the middle, marked) before the
    environment reads it, and a Step's answer is cut to this many characters in all (at most 4
    bytes each: within the 64 MiB gRPC message limit up to the bound of 8 Mi). In the rollout: a
    message it keeps whole (an error text, an interaction's user turn; not cut to
    `max_tool_response_length`) is cut to this many characters."""
    max_tool_calls: int = Field(default=64, ge=1)
    """Calls of one Step past this many are answered with tool errors, not run."""

    @model_validator(mode="after")
    def _check(self) -> EnvironmentConfig:
        check_routing(list(self.endpoints), "environment.endpoints")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("environment.tls_cert_file and tls_key_file go together; set both or neither")
        return self
