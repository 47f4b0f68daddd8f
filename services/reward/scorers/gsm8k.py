"""GSM8K: the answer follows `#### ` (verl's `gsm8k.compute_score`, strict method).

Behaviour matches verl: only the last 300 characters of the response are read, and the last
`#### <number>` there is the answer; commas and `$` are removed; it is
compared to the ground truth as a string; a correct answer scores 1, anything else 0 (verl's
`format_score` defaults to 0, so a well-formed wrong answer also scores 0). One deliberate
deviation: a trailing sentence period (`#### 72.`) is not part of the number, where verl's regex
would keep it and mark a correct answer wrong. Named metrics: `acc` (1/0) and `format` (an answer
after `####` was found).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
_SOLUTION_CLIP_CHARS = 300
"""verl reads only the response's tail (`_SOLUTION_CLIP_CHARS`): an answer before it is not seen."""


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer in the last 300 characters of `solution_str`: after the last `#### ` (strict)
    or the last number (flexible); None when there is none."""
    solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(solution_str)
        return (_clean(found[-1]) or None) if found else None
    if method == "flexible":
        for candidate in reversed(_FLEXIBLE.findall(solution_str)):
            cleaned = _clean(candidate)
            if cleaned:
                return cleaned
        return None
    raise ValueError(f"gsm8k: unknown method {method!r}; use strict or flexible")


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: Mapping[str, Any] | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, float]:
    """verl signature. Returns {"score", "acc", "format"}."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "format": 0.0}
    correct = answer == _clean(ground_truth.strip())
    return {"score": score if correct else format_score, "acc": float(correct), "format": 1.0}
