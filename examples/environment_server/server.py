"""A complete external environment: meshrl.v1.EnvironmentService in ~250 lines of Python, serving
the built-in task `meshrl/tool_add` (three-digit sums with a calculator tool `add(a, b)`).

    python examples/environment_server/server.py --port 50081
    # then, in the meshrl config:
    #   environment:
    #     endpoints:
    #       - address: 127.0.0.1:50081
    #         data_sources: [meshrl/tool_add]

Copy this file and replace `CalculatorEpisode` with your environment (a sandbox, a game, a
simulated user, a search engine ...). Keep the contract (see README.md next to this file):
- one session per trajectory; Start is idempotent by session_id, Step by (session_id, turn): a
  repeated call gets the stored answer and acts once (meshrl retries after a timeout);
- a session idle for session_ttl_s is forgotten (its client died without a Close), then NOT_FOUND;
  a Step of a closed or finished session is FAILED_PRECONDITION, never acted on;
- a malformed, unknown or failing tool call is answered with an error text as the tool's response
  (marked `error`, so the rollout shows it whole, and counted in tool_errors), never with a status
  code: the episode goes on;
- INVALID_ARGUMENT for a malformed request; UNAVAILABLE / RESOURCE_EXHAUSTED for temporary trouble
  (meshrl retries with backoff; after its budget the prompt is re-queued, never scored as zero).

Needs grpcio and meshrl's generated stubs (`pip install meshrl`, or generate them from
protos/meshrl/v1/environment.proto and common.proto; see README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio

from meshrl.v1 import common_pb2, environment_pb2, environment_pb2_grpc

# ---- the environment: replace this with yours ------------------------------------------------------

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers and return their sum.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "description": "the first addend"},
                           "b": {"type": "integer", "description": "the second addend"}},
            "required": ["a", "b"],
        },
    },
}
_ANSWER = re.compile(r"\s*(-?\d+)")


@dataclass
class CalculatorEpisode:
    """One trajectory: the policy may call add(a, b) and must then answer the sum."""

    expected: str
    last_answer: str = ""
    calls: int = 0

    def answer_call(self, call: environment_pb2.ToolCall) -> tuple[str, bool]:
        """(response text, is_error) for one tool call."""
        self.calls += 1
        if call.parse_error:
            return f"Error: the tool call could not be parsed: {call.parse_error}", True
        if call.name != "add":
            return f"Error: unknown tool {call.name!r}; available tools: ['add']", True
        try:
            args = json.loads(call.arguments_json or "{}")
            if not isinstance(args, dict) or set(args) != {"a", "b"}:
                raise ValueError("add takes exactly the arguments a and b")
            a, b = (int(args[k]) for k in ("a", "b"))
            if any(isinstance(args[k], (bool, float)) for k in ("a", "b")):
                raise ValueError("a and b must be integers")
        except RecursionError:  # nested deeper than json.loads reads
            return "Error: invalid arguments for add: nested too deeply", True
        except (ValueError, TypeError) as exc:
            return f"Error: invalid arguments for add: {exc}", True
        return str(a + b), False

    def reward(self) -> float:
        """1 when the final answer's leading number is the sum (the reward service checks the same)."""
        m = _ANSWER.match(self.last_answer)
        return float(m is not None and m.group(1) == self.expected)


def start_episode(prompt: common_pb2.Prompt) -> CalculatorEpisode:
    return CalculatorEpisode(expected=prompt.ground_truth.strip())


# ---- the service -----------------------------------------------------------------------------------


@dataclass
class _Session:
    episode: CalculatorEpisode
    start: environment_pb2.StartResponse
    last_turn: int = -1
    last: environment_pb2.StepResponse | None = None
    done: bool = False
    closed: environment_pb2.CloseResponse | None = None
    last_seen: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class EnvironmentService(environment_pb2_grpc.EnvironmentServiceServicer):
    def __init__(self, token: str | None = None, max_sessions: int = 10_000, *, session_ttl_s: float = 900.0,
                 closed_keep_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.token = token
        self.max_sessions = max_sessions
        self.session_ttl_s = session_ttl_s
        self.closed_keep_s = closed_keep_s
        self.clock = clock
        self.sessions: dict[str, _Session] = {}
        self._next_sweep = 0.0

    def _expire(self) -> None:
        """Forget sessions idle past session_ttl_s and closed ones past closed_keep_s. A client that
        dies mid-episode never sends Close: kept forever, its sessions fill max_sessions and every
        Start is RESOURCE_EXHAUSTED for the rest of the run. Release what an episode holds (a
        sandbox, a container) here too."""
        now = self.clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(30.0, self.session_ttl_s / 2)
        for sid, s in list(self.sessions.items()):
            if now - s.last_seen > (self.session_ttl_s if s.closed is None else self.closed_keep_s):
                del self.sessions[sid]

    async def _auth(self, context: grpc.aio.ServicerContext) -> None:
        if self.token:
            md = dict(context.invocation_metadata() or ())
            if not hmac.compare_digest(md.get("authorization", ""), f"Bearer {self.token}"):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def Start(self, request: environment_pb2.StartRequest, context: grpc.aio.ServicerContext) -> environment_pb2.StartResponse:
        await self._auth(context)
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id: must be non-empty")
        self._expire()
        s = self.sessions.get(request.session_id)
        if s is None:  # a repeated Start gets the first answer
            if len(self.sessions) >= self.max_sessions:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many open sessions; retry later")
            start = environment_pb2.StartResponse(session_id=request.session_id, tools_json=[json.dumps(ADD_TOOL)])
            s = self.sessions[request.session_id] = _Session(start_episode(request.prompt), start)
        s.last_seen = self.clock()
        return s.start

    async def Step(self, request: environment_pb2.StepRequest, context: grpc.aio.ServicerContext) -> environment_pb2.StepResponse:
        await self._auth(context)
        s = self.sessions.get(request.session_id)
        if s is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r}")
            raise AssertionError("unreachable")
        async with s.lock:
            if s.closed is not None:  # a late duplicate: the reward is already given, the episode must not act
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"session {request.session_id!r} is closed")
            s.last_seen = self.clock()
            if request.turn == s.last_turn and s.last is not None:
                return s.last  # a retry: the stored answer, the episode does not act twice
            if s.done:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"session {request.session_id!r} is done (turn {s.last_turn} ended the episode)")
            if request.turn != s.last_turn + 1:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"session {request.session_id!r}: turn "
                                    f"{request.turn} out of order; the next turn is {s.last_turn + 1}")
            reply = self._step(s.episode, request)
            s.last_turn, s.last, s.done = request.turn, reply, reply.done
            return reply

    def _step(self, ep: CalculatorEpisode, request: environment_pb2.StepRequest) -> environment_pb2.StepResponse:
        reply = environment_pb2.StepResponse(session_id=request.session_id, turn=request.turn)
        if not request.tool_calls:  # an answer: the episode is over
            ep.last_answer = request.assistant_text
            reply.done = True
            return reply
        for call in request.tool_calls:
            text, error = ep.answer_call(call)
            reply.messages.add(role="tool", content=text, error=error)  # shown whole, not cut as a tool's answer
            reply.tool_errors += int(error)
        reply.metrics["tool_calls"] = float(len(request.tool_calls))
        return reply

    async def Close(self, request: environment_pb2.CloseRequest, context: grpc.aio.ServicerContext) -> environment_pb2.CloseResponse:
        await self._auth(context)
        s = self.sessions.get(request.session_id)
        if s is None:
            # Unknown (never started, or lost in a restart): an empty answer would be taken as
            # "no final reward", and the trajectory trained without it.
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r}")
            raise AssertionError("unreachable")
        if s.closed is None:
            s.closed = environment_pb2.CloseResponse(reward=s.episode.reward(), metrics={"calls": float(s.episode.calls)})
            # Kept for a repeated Close closed_keep_s, then _expire forgets the session.
            s.last_seen = self.clock()
        return s.closed


async def start_server(
    host: str = "127.0.0.1", port: int = 50081, *, token: str | None = None, tls_cert: str | None = None,
    tls_key: str | None = None, session_ttl_s: float = 900.0,
) -> tuple[grpc.aio.Server, int]:
    """Start the service; returns (server, bound port). Port 0 picks a free one."""
    server = grpc.aio.server()
    environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(EnvironmentService(token, session_ttl_s=session_ttl_s), server)
    address = f"{host}:{port}"
    if tls_cert and tls_key:
        with open(tls_key, "rb") as k, open(tls_cert, "rb") as c:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    return server, bound


async def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="An example meshrl.v1.EnvironmentService (the calculator task).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50081)
    p.add_argument("--token", default=os.environ.get("ENVIRONMENT_TOKEN"), help="require this bearer token (or ENVIRONMENT_TOKEN)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (enables TLS with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    p.add_argument("--session-ttl-s", type=float, default=900.0,
                   help="forget a session after this many seconds without a call (its client died)")
    args = p.parse_args(argv)
    server, port = await start_server(args.host, args.port, token=args.token, tls_cert=args.tls_cert, tls_key=args.tls_key,
                                      session_ttl_s=args.session_ttl_s)
    print(f"environment server listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2.0)


if __name__ == "__main__":
    asyncio.run(main())
