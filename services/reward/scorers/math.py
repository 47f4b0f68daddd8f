"""Math answers checked with Math-Verify (boxed answers, equivalent forms: 1/2 = \\frac{1}{2} =
0.5, sets, intervals, simplified expressions).

Behaviour matches verl's `math_verify.compute_score`: the ground truth is wrapped in `\\boxed{}` and
parsed as LaTeX; the response is parsed with expression and LaTeX extraction; correct scores 1,
anything else 0. Math-Verify's own timeouts use SIGALRM, which only works on a process's main
thread (verl's wrapper therefore silently scores 0 when called from a thread); here they are off
and the pipeline enforces `reward.item_timeout_s` around the call instead.

`compute_score_dapo` is the DAPO convention (verl's `math_dapo`: data_source `math_dapo` and
`aime*`): +1 correct, -1 otherwise, on the last 300 characters of the response. verl decides
correctness there by normalised string match on an `Answer:` line; here Math-Verify decides it,
which also accepts equivalent forms.

Metrics: `acc` (1/0), `format` (an answer could be extracted), `invalid_ground_truth` (1 when the
ground truth itself does not parse: no response can be right; the item scores 0 and a warning is
logged).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

from services.common.errors import MissingDependency
from services.common.logging import get_logger

log = get_logger(__name__)

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as exc:  # math-verify is a core dependency; say how to get it back
    raise MissingDependency("math-verify (math answer checking)", "pip install 'math-verify>=0.8'") from exc



class _DropTimeoutNotice(logging.Filter):
    """Math-Verify warns once that its timeouts are off; the pipeline's deadline replaces them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_DropTimeoutNotice())

_GOLD_CONFIG = (LatexExtractionConfig(),)
_PRED_CONFIG = (ExprExtractionConfig(), LatexExtractionConfig())
DAPO_TAIL_CHARS = 300


@functools.lru_cache(maxsize=65536)
def _gold(ground_truth: str) -> tuple[Any, ...]:
    # Parsed ground truths are immutable sympy objects: safe to share between threads.
    return tuple(parse("\\boxed{" + ground_truth + "}", extraction_config=_GOLD_CONFIG, parsing_timeout=None))


def check(solution_str: str, ground_truth: str) -> tuple[bool, bool, bool]:
    """(correct, an answer was extracted, the ground truth parsed)."""
    gold = list(_gold(ground_truth.strip()))
    if not gold:
        log.warning("math_ground_truth_unparsable", ground_truth=ground_truth[:200])
        return False, False, False
    pred = parse(solution_str, extraction_config=_PRED_CONFIG, parsing_timeout=None)
    if not pred:
        return False, False, True
    return bool(verify(gold, pred, timeout_seconds=None)), True, True


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None
) -> dict[str, float]:
    """verl signature. 1 correct, 0 otherwise."""
    correct, extracted, gold_ok = check(solution_str, ground_truth)
    return {
        "score": float(correct),
        "acc": float(correct),
        "format": float(extracted),
        "invalid_ground_truth": float(not gold_ok),
    }


def compute_score_dapo(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None
) -> dict[str, float]:
    """verl signature, DAPO's reward: +1 correct, -1 otherwise."""
    correct, extracted, gold_ok = check(solution_str[-DAPO_TAIL_CHARS:], ground_truth)
    return {
        "score": 1.0 if correct else -1.0,
        "acc": float(correct),
        "format": float(extracted),
        "invalid_ground_truth": float(not gold_ok),
    }
