"""GSM8K: the answer follows `#### ` (verl's `gsm8k.compute_score`, strict method).

Behaviour matches verl: the first `#### <number>` is the answer; commas and `$` are removed; it is
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


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer in `solution_str`: after the first `#### ` (strict) or the last number
    (flexible); None when there is none."""
    if method == "strict":
        m = _STRICT.search(solution_str)
        return (_clean(m.group(1)) or None) if m is not None else None
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
