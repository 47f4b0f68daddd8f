"""The gateway's HTTP surface (FastAPI) and the server each rollout replica runs it on.

    POST /sessions/{id}/v1/chat/completions   OpenAI chat completions (stream: server-sent events)
    POST /sessions/{id}/v1/completions        OpenAI text completions
    GET  /sessions/{id}/v1/models             the policy, as the one model
    POST /sessions/{id}/finish                {"reward": x} or {}: the sample is done

Every route takes `Authorization: Bearer <the session's key>` (the OpenAI SDKs send OPENAI_API_KEY
so). Order per request: the key (401), the body (413 / 400 naming the field), then the session's
state (409); a refused request changes nothing (but one refused for the response budget or the
context ends its open sample's trajectory with `length`, its tokens as they were).

Why a server per replica rather than Serve's HTTP proxy: a session's calls must reach the replica
that holds its lease and its tokens, and Serve's proxy balances requests over replicas with no
affinity. Each replica serves its own sessions on `agent.host:agent.port` (port 0: a free one) and
hands agents that address. Streaming goes out token by token as the engine samples
(streaming.py), in OpenAI's chunk format.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.logging import get_logger

from .openai_api import (
    ApiError,
    bad,
    chat_response,
    completion_response,
    models_response,
    now,
    parse_chat,
    parse_completion,
)
from .sessions import SampleSession, SessionRegistry
from .streaming import StreamSpec, open_stream

log = get_logger(__name__)


def build_app(registry: SessionRegistry, *, max_request_bytes: int = 4 * 1024 * 1024) -> FastAPI:
    app = FastAPI(title="meshrl gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(_: Request, exc: StarletteHTTPException) -> Response:
        # A path or method this server does not serve: OpenAI's error object (the SDKs read its
        # message), saying what is served, where FastAPI would answer {"detail": "Not Found"}.
        return JSONResponse(ApiError(exc.status_code, f"{exc.detail}: this gateway serves POST chat/completions, POST "
                                     "completions and GET models under the base URL meshrl gave the agent "
                                     "(/sessions/<id>/v1), and POST /sessions/<id>/finish").body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        # A bug or an engine failure: OpenAI's error JSON (the SDKs raise InternalServerError), and
        # the traceback in the replica's log without the request.
        log.error("gateway_internal_error", error=repr(exc)[:500], exc_info=exc)
        return JSONResponse(ApiError(500, f"internal error in the gateway: {type(exc).__name__}").body(), status_code=500)

    async def body_of(request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_bytes:
            raise ApiError(413, f"request body over agent.max_request_bytes={max_request_bytes}", code="request_too_large")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_request_bytes:
                raise ApiError(413, f"request body over agent.max_request_bytes={max_request_bytes}",
                               code="request_too_large")
        try:
            return json.loads(raw or b"{}")
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's digit limit
            raise bad("body", f"is not valid JSON ({exc})") from exc
        except RecursionError:
            raise bad("body", "nests deeper than this server parses") from None

    def authenticate(session_id: str, request: Request) -> Callable[[], SampleSession]:
        """The key now (401); the session's state (409 for one whose group has ended) when the
        returned function is called, after the body's validation."""
        try:
            s = registry.authenticate(session_id, request.headers.get("authorization"))
        except ApiError as exc:
            if exc.status != 409:
                raise
            ended = exc

            def closed() -> SampleSession:
                raise ended

            return closed
        return lambda: s

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat(session_id: str, request: Request) -> Response:
        session = authenticate(session_id, request)
        req = parse_chat(await body_of(request))
        s = session()
        if req.stream:
            spec = StreamSpec("chat", s.response_id("chatcmpl"), req.model or registry.limits.model_name,
                              now(), bool(req.tools) and req.tool_choice != "none", registry.stop_strings(s, req.stop),
                              req.logprobs, req.include_usage)
            events = await open_stream(lambda on_token: registry.chat(s, req, on_token), spec, registry.tok,
                                       registry.counters)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(chat_response(await registry.chat(s, req), req.logprobs))

    @app.post("/sessions/{session_id}/v1/completions")
    async def completions(session_id: str, request: Request) -> Response:
        session = authenticate(session_id, request)
        req = parse_completion(await body_of(request))
        s = session()
        if req.stream:
            spec = StreamSpec("completion", s.response_id("cmpl"), req.model or registry.limits.model_name,
                              now(), False, registry.stop_strings(s, req.stop), req.logprobs, req.include_usage)
            events = await open_stream(lambda on_token: registry.complete(s, req, on_token), spec, registry.tok,
                                       registry.counters)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(completion_response(await registry.complete(s, req), req.logprobs))

    @app.get("/sessions/{session_id}/v1/models")
    async def models(session_id: str, request: Request) -> Response:
        registry.authenticate(session_id, request.headers.get("authorization"))
        return JSONResponse(models_response(registry.limits.model_name))

    @app.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        session = authenticate(session_id, request)
        body = await body_of(request)
        if not isinstance(body, dict):
            raise bad("body", 'must be a JSON object: {"reward": x} or {}')
        reward = body.get("reward")
        # abs() <= the largest float: rejects NaN and infinities, and an int that float() would overflow on
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                   or not abs(reward) <= sys.float_info.max):
            raise bad("reward", f"must be a finite number or absent (then the reward service scores), got {reward!r}")
        if set(body) - {"reward"}:
            raise bad(sorted(set(body) - {"reward"})[0], "unknown field; /finish takes only reward")
        s = session()
        await registry.finish(s, None if reward is None else float(reward))
        return JSONResponse({"session_id": session_id, "state": s.state})

    return app


class GatewayServer:
    """uvicorn serving the app on the running event loop (the replica's), until stop()."""

    def __init__(self, app: Any, host: str, port: int, *, limit_concurrency: int = 1024) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            def install_signal_handlers(self) -> None:  # the replica owns its signals
                return None

            @contextlib.contextmanager
            def capture_signals(self) -> Any:
                yield

        self._server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                              lifespan="off", timeout_keep_alive=30,
                                              limit_concurrency=limit_concurrency))
        self._task: asyncio.Task[None] | None = None
        self.host = host
        self.port = port

    async def start(self, timeout_s: float = 30.0) -> int:
        """Listen; returns the bound port."""
        self._task = asyncio.get_running_loop().create_task(self._server.serve(), name="gateway-http")
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError(f"the gateway server on {self.host}:{self.port} stopped at start")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the gateway server on {self.host}:{self.port} did not start in {timeout_s} s")
            await asyncio.sleep(0.02)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])
        log.info("gateway_listening", host=self.host, port=self.port)
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, 10)
        self._task = None
