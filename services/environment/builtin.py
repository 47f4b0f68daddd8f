"""Built-in tools: the calculator of the built-in task `meshrl/tool_add` (configs/examples/
tool_add_tools.yaml). Written against the verl-compatible base class, like any user tool."""

from __future__ import annotations

from typing import Any

from .tools import BaseTool, ToolResponse


def _integer(value: Any, name: str) -> int:
    # JSON has one number type; accept 12 and "12", refuse 1.5, true and "abc" with a reason.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    raise ValueError(f"{name} must be an integer, got {value!r}")


class AddTool(BaseTool):
    """`add(a, b)`: the sum of two integers, as text."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        unknown = sorted(set(parameters) - {"a", "b"})
        if unknown or "a" not in parameters or "b" not in parameters:
            raise ValueError(f"add takes exactly the arguments a and b, got {sorted(parameters)}")
        a, b = _integer(parameters["a"], "a"), _integer(parameters["b"], "b")
        return ToolResponse(text=str(a + b)), 0.0, {}
