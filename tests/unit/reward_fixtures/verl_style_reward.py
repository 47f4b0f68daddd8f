# A reward file written the way verl users write them for `custom_reward_function.path`
# (module-level helpers, keyword-compatible `compute_score`, a dict result with extra keys,
# `extra_info` may be None). meshrl must load and call it unchanged.
import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(solution_str):
    matches = _ANSWER.findall(solution_str)
    if not matches:
        return None
    return matches[-1].strip()


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    pred = extract_answer(solution_str)
    if pred is None:
        return {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    correct = pred == ground_truth
    bonus = 0.0
    if extra_info is not None and extra_info.get("difficulty") == "hard" and correct:
        bonus = 0.5
    return {"score": (1.0 if correct else 0.0) + bonus, "acc": correct, "pred": pred}


def compute_score_scaled(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    """Returns a bare float; `scale` comes from custom_reward_function.reward_kwargs."""
    return float(extract_answer(solution_str) == ground_truth) * scale


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos):
    """verl's BatchRewardManager signature: lists in, one result per item out."""
    results = []
    for i in range(len(solution_strs)):
        pred, truth = extract_answer(solution_strs[i]), ground_truths[i]
        results.append({"score": float(pred == truth), "acc": pred == truth, "batch_size": len(solution_strs)})
    return results
