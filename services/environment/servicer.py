"""EnvironmentService over gRPC: proto in -> validate -> SessionTable -> proto out (or a status
code through rpc_method). Used by the plain server (server.py); an embedding may host it anywhere
a grpc.aio servicer fits."""

from __future__ import annotations

from typing import Any

from meshrl.v1 import environment_pb2, environment_pb2_grpc
from services.common.errors import InvalidArgument
from services.common.grpc_util import rpc_method
from services.common.jsonutil import DEFAULT_MAX_DEPTH

from . import convert
from .core import SessionTable


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    """Thin shim over SessionTable. Validation happens before the table is touched, so a rejected
    request leaves no trace. What a sampled turn may overrun (too many calls, a long text) is no
    reason to reject: the table bounds it (core.py)."""

    def __init__(self, table: SessionTable, *, max_json_depth: int = DEFAULT_MAX_DEPTH) -> None:
        self.table = table
        self.max_json_depth = max_json_depth

    @rpc_method()
    async def Start(self, request: environment_pb2.StartRequest, context: Any) -> environment_pb2.StartResponse:
        sid = convert.require_session_id(request.session_id)
        if not request.HasField("prompt"):
            raise InvalidArgument("prompt", "missing (the leased prompt)")
        prompt = convert.prompt_from_proto(request.prompt, max_depth=self.max_json_depth)
        result = await self.table.start(sid, prompt, sample_index=request.sample_index, policy_version=request.policy_version)
        return convert.start_response(sid, result)

    @rpc_method()
    async def Step(self, request: environment_pb2.StepRequest, context: Any) -> environment_pb2.StepResponse:
        sid = convert.require_session_id(request.session_id)
        calls = convert.tool_calls_from_request(request)
        result = await self.table.step(sid, request.turn, request.assistant_text, calls, policy_version=request.policy_version)
        return convert.step_response(sid, request.turn, result)

    @rpc_method()
    async def Close(self, request: environment_pb2.CloseRequest, context: Any) -> environment_pb2.CloseResponse:
        sid = convert.require_session_id(request.session_id)
        return convert.close_response(await self.table.close(sid))
