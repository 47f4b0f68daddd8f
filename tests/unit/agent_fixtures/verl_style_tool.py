"""verl's demo tool (verl/tools/gsm8k_tool.py) with only its imports changed: the base classes
from meshrl instead of verl, and the answer check written out instead of verl.utils.reward_score
(verl's `rollout_trace_op` decorator is dropped: it only traces)."""

import re
from typing import Any
from uuid import uuid4

from services.environment.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse


def _gsm8k_score(solution: str, ground_truth: str) -> float:
    numbers = re.findall(r"-?\d+", solution.replace(",", ""))
    return 1.0 if numbers and numbers[-1] == ground_truth else 0.0


class Gsm8kTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        if answer.startswith("#### "):
            self._instance_dict[instance_id]["response"] = answer
        else:
            self._instance_dict[instance_id]["response"] = "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > self._instance_dict[instance_id]["reward"] else -0.05
        self._instance_dict[instance_id]["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return _gsm8k_score(self._instance_dict[instance_id]["response"], self._instance_dict[instance_id]["ground_truth"])

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
