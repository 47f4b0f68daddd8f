"""Custom reward functions for the scorer-process tests (loaded by path, as custom_reward_function)."""

from __future__ import annotations

from typing import Any


def exact(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    return float(solution_str.strip() == ground_truth.strip())


def spin(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """Burns a core forever: only killing its process stops it."""
    n = 0
    while True:
        n += 1


def raises(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    raise ValueError("no")


def echo(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """The answer as the score, after `extra_info["sleep"]` seconds: which call a score came from."""
    import time

    time.sleep(float((extra_info or {}).get("sleep", 0)))
    return float(solution_str)
