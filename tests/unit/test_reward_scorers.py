"""Built-in scorers against real examples: right, wrong, malformed, equivalent forms."""

from __future__ import annotations

import pytest

from services.reward import scorers
from services.reward.scorers import gsm8k, math, synthetic

# ---- GSM8K (verl strict) -------------------------------------------------------------------------

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    ("response", "truth", "score", "fmt"),
    [
        (GSM8K_SOLUTION, "72", 1.0, 1.0),  # a real GSM8K reference solution
        ("The total is #### 1,234", "1234", 1.0, 1.0),  # thousands separator
        ("#### $18", "18", 0.0, 0.0),  # verl's regex needs a digit right after "#### "
        ("so #### 72.", "72", 1.0, 1.0),  # trailing sentence period (deliberate fix over verl)
        ("#### -3", "-3", 1.0, 1.0),
        ("#### 71", "72", 0.0, 1.0),  # wrong but well-formed: verl's format_score is 0
        ("The answer is 72", "72", 0.0, 0.0),  # right number, missing the #### format
        ("####72", "72", 0.0, 0.0),  # malformed: no space
        ("", "72", 0.0, 0.0),
        ("#### 5 then #### 72", "72", 1.0, 1.0),  # the last #### counts (verl: re.findall(...)[-1])
        ("#### 72.0", "72", 0.0, 1.0),  # string comparison, as verl
    ],
)
def test_gsm8k(response: str, truth: str, score: float, fmt: float) -> None:
    out = gsm8k.compute_score("openai/gsm8k", response, truth)
    assert out["score"] == score
    assert out["acc"] == score
    assert out["format"] == fmt


def test_gsm8k_flexible_takes_the_last_number() -> None:
    assert gsm8k.extract_solution("first 3 then 4.", method="flexible") == "4"
    assert gsm8k.extract_solution("no digits here", method="flexible") is None


# ---- Math-Verify ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "truth", "correct"),
    [
        ("So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", True),  # boxed fraction vs decimal
        ("Therefore \\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{\\dfrac{3}{4}}", "3/4", True),
        ("The answer is 1/2", "\\frac12", True),  # plain text, shorthand \frac in the truth
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),  # equal after simplification
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", True),  # sets ignore order
        ("\\boxed{3}", "4", False),
        ("I am not sure.", "4", False),  # malformed: nothing to extract
        ("\\boxed{", "5", False),  # malformed LaTeX
        ("", "5", False),
    ],
)
def test_math_verify(response: str, truth: str, correct: bool) -> None:
    out = math.compute_score("lighteval/MATH", response, truth)
    assert out["score"] == float(correct)
    assert out["acc"] == float(correct)
    assert out["invalid_ground_truth"] == 0.0


def test_math_format_metric_and_bad_ground_truth() -> None:
    assert math.compute_score("lighteval/MATH", "I am not sure.", "4")["format"] == 0.0
    assert math.compute_score("lighteval/MATH", "\\boxed{4}", "4")["format"] == 1.0
    out = math.compute_score("lighteval/MATH", "\\boxed{4}", "}{")
    assert out["score"] == 0.0 and out["invalid_ground_truth"] == 1.0


def test_math_dapo_is_plus_minus_one_on_the_tail() -> None:
    assert math.compute_score_dapo("math_dapo", "... so \\boxed{204}", "204") == {
        "score": 1.0, "acc": 1.0, "format": 1.0, "invalid_ground_truth": 0.0,
    }
    assert math.compute_score_dapo("aime2024", "\\boxed{203}", "204")["score"] == -1.0
    # Only the last 300 characters count (DAPO's rule): an early answer followed by rambling is missed.
    assert math.compute_score_dapo("math_dapo", "\\boxed{204}" + " filler" * 60, "204")["score"] == -1.0


# ---- synthetic tasks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "truth", "score", "parsed", "fmt", "digits"),
    [
        ("68", "68", 1.0, 1.0, 1.0, 1.0),
        ("68</s>", "68", 1.0, 1.0, 1.0, 1.0),  # answer then EOS, as the tiny model emits it
        (" 68 <|im_end|>", "68", 1.0, 1.0, 1.0, 1.0),
        ("68+1=69", "68", 1.0, 1.0, 0.0, 1.0),  # right answer, junk after it: correct, bad format
        ("67</s>", "68", 0.0, 1.0, 1.0, 0.5),  # one digit off: partial credit only as a metric
        ("6812", "68", 0.0, 1.0, 1.0, 0.5),  # extra digits are part of the answer
        ("068", "68", 0.0, 1.0, 1.0, 0.0),  # not the canonical form
        ("-68", "68", 0.0, 1.0, 1.0, 0.0),
        ("</s>", "68", 0.0, 0.0, 0.0, 0.0),  # empty answer
        ("sixty-eight", "68", 0.0, 0.0, 0.0, 0.0),
        ("", "68", 0.0, 0.0, 0.0, 0.0),
        ("0314", "0314", 1.0, 1.0, 1.0, 1.0),  # copy task keeps leading zeros
    ],
)
def test_synthetic(response: str, truth: str, score: float, parsed: float, fmt: float, digits: float) -> None:
    out = synthetic.compute_score("meshrl/addition", response, truth)
    assert out["score"] == score
    assert out["acc"] == score
    assert out["parsed"] == parsed
    assert out["format"] == fmt
    assert out["digit_match"] == pytest.approx(digits)


def test_synthetic_tasks_score_real_prompts() -> None:
    from services.common.data import synthetic_records

    for task in ("addition", "copy"):
        for rec in synthetic_records(task, 5, digits=3, seed=1, split="train").records:
            assert synthetic.compute_score(rec.data_source, rec.ground_truth + "</s>", rec.ground_truth)["score"] == 1.0
            wrong = str(int(rec.ground_truth) + 1)
            assert synthetic.compute_score(rec.data_source, wrong, rec.ground_truth)["score"] == 0.0


# ---- registry ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data_source", "name"),
    [
        ("openai/gsm8k", "gsm8k"),
        ("lighteval/MATH", "math_verify"),
        ("DigitalLearningGmbH/MATH-lighteval", "math_verify"),
        ("numina_olympiads", "math_verify"),
        ("math_dapo", "math_dapo"),
        ("aime2024", "math_dapo"),
        ("meshrl/addition", "synthetic"),
        ("meshrl/copy", "synthetic"),
    ],
)
def test_registry_routes_by_data_source(data_source: str, name: str) -> None:
    spec = scorers.find(data_source)
    assert spec is not None and spec.name == name
    assert callable(scorers.load(spec))


def test_registry_unknown() -> None:
    assert scorers.find("my/own-task") is None
    assert "openai/gsm8k" in scorers.known_data_sources()
    assert "aime*" in scorers.known_data_sources()
