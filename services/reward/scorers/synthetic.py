"""The built-in synthetic tasks (services/common/data.py): `meshrl/addition` ("23+45=" -> "68"),
`meshrl/copy` ("copy 3141:" -> "3141") and `meshrl/tool_add` ("123+456=" -> "579", answered by a
policy that may call the calculator tool; the rollout sends the final assistant turn, so the answer
must follow the tool's result, not be it).

How a response is read. The tiny policy answers right after the prompt, then emits its
end-of-sequence token. The answer is the leading run of digits of the response, after optional
whitespace (an optional leading `-` is kept, so "-68" is a wrong answer, not 68). It is compared as
a string with the ground truth (so "068" is wrong for 68: the canonical form is what the model must
learn). Anything after the digits does not change correctness.

Score (what the trainer uses): 1 if the answer equals the ground truth, else 0. Nothing else adds
to it. Named metrics, for logging and curricula only:
- `acc`: same as the score;
- `parsed`: the response starts with a number;
- `format`: the response is exactly the number, optionally followed by whitespace and special
  tokens such as `</s>` or `<|im_end|>` (the clean "answer then EOS" shape);
- `digit_match`: partial credit, the fraction of digit positions (aligned from the left, over the
  longer of answer and ground truth) that agree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_LEADING = re.compile(r"\s*(-?\d+)")
_CLEAN_TAIL = re.compile(r"(?:\s|<\|?[\w/]{1,32}\|?>)*")


def parse_answer(response: str) -> tuple[str | None, str]:
    """(leading number or None, the rest of the response)."""
    m = _LEADING.match(response)
    if m is None:
        return None, response
    return m.group(1), response[m.end() :]


def digit_match(answer: str, truth: str) -> float:
    width = max(len(answer), len(truth))
    if width == 0:
        return 0.0
    return sum(a == b for a, b in zip(answer, truth, strict=False)) / width


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None
) -> dict[str, float]:
    """verl signature. Returns {"score", "acc", "parsed", "format", "digit_match"}."""
    truth = ground_truth.strip()
    answer, rest = parse_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "parsed": 0.0, "format": 0.0, "digit_match": 0.0}
    correct = answer == truth
    return {
        "score": float(correct),
        "acc": float(correct),
        "parsed": 1.0,
        "format": float(_CLEAN_TAIL.fullmatch(rest) is not None),
        "digit_match": digit_match(answer, truth),
    }
