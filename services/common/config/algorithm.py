"""`algorithm.*`, `reward_model.*`, `custom_reward_function.*`: verl's algorithm knobs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from .base import ConfigModel


class KLControlConfig(ConfigModel):
    """KL-in-reward controller (verl `algorithm.kl_ctrl`)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed or adaptive coefficient."""
    kl_coef: float = 0.001
    """Initial coefficient."""
    horizon: int = 10000
    """Adaptive controller horizon."""
    target_kl: float = 0.1
    """Adaptive controller target."""


class RolloutCorrectionConfig(ConfigModel):
    """Off-policy correction between the rollout (behaviour) policy and the trained policy
    (verl `algorithm.rollout_correction`)."""

    bypass_mode: bool = True
    """True: old logprobs = rollout logprobs (the PPO ratio absorbs off-policyness). False:
    decoupled PPO, old (proximal) logprobs recomputed with the parameters at the start of the
    sync window, and rollout IS/RS applied between proximal and behaviour policy."""
    rollout_is: Literal["token", "sequence"] | None = None
    """Importance-sampling weight level; null: none."""
    rollout_is_threshold: float | str = 2.0
    """Float: truncated-IS upper clamp (TIS). "lo_hi" string: two-sided mask (IcePop-style)."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """`truncate` clamps weights above the threshold; `mask` zeroes tokens/sequences outside."""
    rollout_rs: Literal["token_k1", "seq_mean_k1", "seq_sum_k1", "seq_mean_k3", "seq_max_k2"] | None = None
    """Rejection sampling metric; null: none."""
    rollout_rs_threshold: float | str | None = None
    """Upper bound, or "lo_hi" for a two-sided bound, of the rejection metric."""
    rollout_is_batch_normalize: bool = False
    """Normalize IS weights to mean 1 over the batch."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Policy-gradient form used with the correction."""

    @model_validator(mode="after")
    def _rs_threshold(self) -> RolloutCorrectionConfig:
        if self.rollout_rs is not None and self.rollout_rs_threshold is None:
            raise ValueError("rollout_rs is set but rollout_rs_threshold is null; set algorithm.rollout_correction.rollout_rs_threshold")
        return self


class FilterGroupsConfig(ConfigModel):
    """DAPO dynamic sampling (verl `algorithm.filter_groups`)."""

    enable: bool = False
    """Drop groups whose metric is constant across responses and fetch more."""
    metric: str = "acc"
    """Metric compared across a group's responses (`acc`, `score`, or a reward metric)."""
    max_num_gen_batches: int = 0
    """Give up after this many extra fetches per step (0 = no limit)."""


class AlgorithmConfig(ConfigModel):
    """verl's `algorithm` section."""

    adv_estimator: Literal["grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = "grpo"
    """Advantage estimator."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group std (false = Dr.GRPO style)."""
    gamma: float = 1.0
    """Discount (REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda (unused by the group estimators)."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty from the reward."""
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl"] = "kl"
    """KL estimator for the in-reward penalty."""
    kl_ctrl: KLControlConfig = KLControlConfig()
    """KL-in-reward controller."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Off-policy corrections."""
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    """DAPO dynamic sampling."""


class OverlongBufferConfig(ConfigModel):
    """DAPO overlong reward shaping."""

    enable: bool = False
    """Penalize responses in the last `len` tokens before the cap."""
    len: int = 0
    """Buffer length in tokens."""
    penalty_factor: float = 1.0
    """Penalty at the cap (linear in the buffer)."""
    log: bool = False
    """Report the penalty as a reward metric."""


class RewardModelConfig(ConfigModel):
    """verl's `reward_model` section (rule-based rewards; model-based RMs go behind an endpoint)."""

    enable: bool = False
    """A model-based reward model (not built in; use reward.endpoints)."""
    reward_manager: Literal["naive", "dapo", "batch"] = "naive"
    """How scores are assembled (`dapo` adds overlong shaping)."""
    overlong_buffer: OverlongBufferConfig = OverlongBufferConfig()
    """DAPO overlong shaping."""


class CustomRewardFunctionConfig(ConfigModel):
    """verl's `custom_reward_function`: `compute_score(data_source, solution_str, ground_truth,
    extra_info)` returning a float or a dict with `score`."""

    path: str | None = None
    """Python file or importable module with the function."""
    name: str = "compute_score"
    """Function name."""
    reward_kwargs: dict[str, Any] = {}
    """Extra keyword arguments passed to the function on every call (verl's `reward_kwargs`)."""
