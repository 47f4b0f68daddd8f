"""A verifiers environment defined in code, with verifiers' own classes: `meshrl/tool_add`'s task
("123+456=" -> "579") as a `vf.ToolEnv` with the calculator tool `add(a, b)` and a `vf.Rubric`
whose one reward function checks the last answer. The dataset is made here (no hub download),
from the same kind of prompts meshrl's synthetic `tool_add` data leases, so an agent program can
play any leased prompt through this environment: `input_from_prompt` turns meshrl's prompt JSON
into verifiers' RolloutInput, the answer being the environment's own reference for the question.

Runs in .venv-verifiers (scripts/setup_verifiers.sh), not in meshrl's venv."""

from __future__ import annotations

import random
from typing import Any

import datasets
import verifiers as vf
from datasets import Dataset

datasets.disable_progress_bars()  # an agent's stderr is what meshrl shows when it fails


def add(a: int, b: int) -> int:
    """Add two integers and return their sum.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def reference(question: str) -> str:
    """The correct answer to "a+b=" (the environment's ground truth)."""
    left, _, right = question.strip().rstrip("=").partition("+")
    return str(int(left) + int(right))


def correct_answer(completion: Any, answer: str, parser: vf.Parser) -> float:
    """The rubric's reward: 1.0 when the last assistant message is exactly the sum, else 0.0."""
    given = parser.parse_answer(completion)
    return 1.0 if given is not None and given.strip() == answer else 0.0


def make_dataset(num_examples: int, digits: int = 3, seed: int = 0) -> Dataset:
    rng = random.Random(f"verifiers-addition:{seed}")
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    rows = []
    for _ in range(num_examples):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b)})
    return Dataset.from_list(rows)


def load_environment(num_examples: int = 32, digits: int = 3, seed: int = 0, max_turns: int = 3) -> vf.ToolEnv:
    """verifiers' entry-point convention (`vf.load_environment` looks for this function)."""
    rubric = vf.Rubric(funcs=[correct_answer], weights=[1.0])
    data = make_dataset(num_examples, digits, seed)
    return vf.ToolEnv(dataset=data, eval_dataset=data, tools=[add], rubric=rubric, max_turns=max_turns)


def input_from_prompt(prompt: dict[str, Any]) -> dict[str, Any]:
    """A leased meshrl prompt (the agent's stdin JSON) as verifiers' RolloutInput."""
    messages = list(prompt["messages"])
    question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    return {"prompt": messages, "answer": reference(question), "example_id": int(prompt.get("sample_index", 0)),
            "info": {"prompt_id": prompt.get("prompt_id", "")}}
