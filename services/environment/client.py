"""RemoteEnvironment: an `Environment` whose sessions live in an external
meshrl.v1.EnvironmentService (one `environment.endpoints[i]`), called through the shared
resilient endpoint client (services/common/endpoints.py: deadlines, retries with jitter, circuit
breaker, TLS, token). The only token sent is the endpoint's own (`token` / `token_env`); meshrl's
role tokens never reach an environment unless its config names one (`token_env:
MESHRL_ROLLOUT_TOKEN`, for a `meshrl environment serve` on the mesh's tokens).

Retries are safe because the service is idempotent by session id and (session, turn). An
endpoint that stays down past `max_wait_s` makes the call fail with UNAVAILABLE: the rollout then
returns the trajectory's lease and its prompt is re-queued (counted), never scored. A reply that
does not decode or does not fit the request (another session, another turn, a non-finite reward, a
role an environment may not send) is BadReply naming the endpoint: its fault, not the sample's (the
group fails and its lease goes back). A refusal of the request (INVALID_ARGUMENT) is raised as
InvalidArgument; the agent loop turns it into a failed group too (the sampled turn is not the
replica's own bad input, on which it stops).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from meshrl.v1 import environment_pb2
from services.common.endpoints import ResilientEndpoint

from . import convert
from .base import CloseResult, Environment, EnvPrompt, StartResult, StepResult, ToolCall
from .config import EnvironmentEndpointConfig

SERVICE = environment_pb2.DESCRIPTOR.services_by_name["EnvironmentService"].full_name


class RemoteEnvironment(Environment):
    """The environment behind `environment.endpoints[index]`."""

    def __init__(
        self,
        cfg: EnvironmentEndpointConfig,
        *,
        index: int = 0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.name = cfg.label
        self.source = f"environment endpoint {cfg.label!r} ({cfg.address}, environment.endpoints[{index}])"
        # No default token: an environment is third-party code, and this process's rollout token
        # would let whoever runs it lease prompts, submit groups and fetch weights.
        self.endpoint = ResilientEndpoint(cfg, source=self.source, service=SERVICE, rng=rng, clock=clock)

    async def start(self, session_id: str, prompt: EnvPrompt, *, sample_index: int = 0, policy_version: int = 0) -> StartResult:
        req = environment_pb2.StartRequest(
            session_id=session_id, prompt=convert.prompt_to_proto(prompt), sample_index=sample_index,
            policy_version=policy_version,
        )
        return await self.endpoint.call(
            "Start", req, environment_pb2.StartResponse, lambda r: convert.start_from_reply(r, session_id, self.source)
        )

    async def step(
        self, session_id: str, turn: int, assistant_text: str, tool_calls: Sequence[ToolCall], *, policy_version: int = 0
    ) -> StepResult:
        req = environment_pb2.StepRequest(
            session_id=session_id, turn=turn, assistant_text=assistant_text,
            tool_calls=[convert.tool_call_to_proto(c) for c in tool_calls], policy_version=policy_version,
        )
        return await self.endpoint.call(
            "Step", req, environment_pb2.StepResponse, lambda r: convert.step_from_reply(r, session_id, turn, self.source)
        )

    async def close(self, session_id: str) -> CloseResult:
        req = environment_pb2.CloseRequest(session_id=session_id)
        return await self.endpoint.call(
            "Close", req, environment_pb2.CloseResponse, lambda r: convert.close_from_reply(r, self.source)
        )

    async def aclose(self) -> None:
        await self.endpoint.close()

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "remote", **self.endpoint.status()}
