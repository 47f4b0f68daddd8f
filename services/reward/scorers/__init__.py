"""Built-in scorers, found by data_source and imported lazily (a scorer's dependencies load only
when a run uses it).

Every built-in has verl's signature `compute_score(data_source, solution_str, ground_truth,
extra_info)` and returns a dict with `score` plus named metrics, so the pipeline treats built-ins
and custom functions alike. `blocking` scorers (Math-Verify: sympy can take seconds) run in the
reward thread pool with a per-item deadline; the others are fast regex checks run inline.

| data_source | scorer | score |
|---|---|---|
| openai/gsm8k | gsm8k (verl strict `####`) | 1 / 0 |
| lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500, numina_*, meshrl/math | math_verify | 1 / 0 |
| math_dapo, math, math_dapo_reasoning, aime* | math_dapo (Math-Verify, DAPO's +1 / -1) | 1 / -1 |
| meshrl/addition, meshrl/copy, meshrl/tool_add | synthetic (leading digits; tool_add: of the final answer) | 1 / 0 |
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.data import ADDITION_SOURCE, COPY_SOURCE, TOOL_ADD_SOURCE

ScoreFn = Callable[..., Any]
"""verl's `compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)` returning
a number or a dict with `score`."""


@dataclass(frozen=True)
class BuiltinScorer:
    """A built-in scorer: which data_sources it takes and where its function lives."""

    name: str
    module: str
    function: str
    blocking: bool
    data_sources: frozenset[str]
    prefixes: tuple[str, ...] = ()
    timeout_score: float = 0.0
    """The score of an item that ran past reward.item_timeout_s: the scorer's "wrong" (never above a
    wrong answer, which would favour responses that make the verifier hang)."""

    def matches(self, data_source: str) -> bool:
        return data_source in self.data_sources or any(data_source.startswith(p) for p in self.prefixes)


BUILTINS: tuple[BuiltinScorer, ...] = (
    BuiltinScorer("gsm8k", f"{__name__}.gsm8k", "compute_score", False, frozenset({"openai/gsm8k"})),
    BuiltinScorer(
        "math_verify", f"{__name__}.math", "compute_score", True,
        frozenset({"lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "meshrl/math"}),
        prefixes=("numina_",),
    ),
    BuiltinScorer("math_dapo", f"{__name__}.math", "compute_score_dapo", True,
                  frozenset({"math_dapo", "math", "math_dapo_reasoning"}), prefixes=("aime",), timeout_score=-1.0),
    BuiltinScorer("synthetic", f"{__name__}.synthetic", "compute_score", False, frozenset({ADDITION_SOURCE, COPY_SOURCE, TOOL_ADD_SOURCE})),
)

_loaded: dict[str, ScoreFn] = {}


def find(data_source: str) -> BuiltinScorer | None:
    """The built-in scorer for `data_source`, or None."""
    for spec in BUILTINS:
        if spec.matches(data_source):
            return spec
    return None


def load(spec: BuiltinScorer) -> ScoreFn:
    """Import the scorer's function (once). A missing optional dependency raises
    MissingDependency naming the package to install."""
    key = f"{spec.module}:{spec.function}"
    fn = _loaded.get(key)
    if fn is None:
        fn = getattr(importlib.import_module(spec.module), spec.function)
        _loaded[key] = fn
    return fn


def known_data_sources() -> list[str]:
    """For error messages: every data_source (and prefix*) a built-in takes."""
    out: list[str] = []
    for spec in BUILTINS:
        out.extend(sorted(spec.data_sources))
        out.extend(f"{p}*" for p in spec.prefixes)
    return out
