"""`algorithm.*`, `reward_model.*`, `custom_reward_function.*`: verl's algorithm knobs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from .base import ConfigModel

ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""Rejection metrics (verl `rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS`, less `binary_kl`)."""


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """`rollout_is_threshold` -> (upper, lower or None). A number (or numeric string) is an upper
    bound; "lo_hi" (e.g. "0.5_5.0") is a two-sided bound. Raises ValueError naming the key."""
    key = "algorithm.rollout_correction.rollout_is_threshold"
    if isinstance(spec, bool):
        raise ValueError(f"{key} must be a number or a 'lo_hi' string, not a boolean")
    lower: float | None
    if isinstance(spec, int | float):
        upper, lower = float(spec), None
    else:
        text = spec.strip()
        try:
            if "_" in text:
                lo, hi = text.split("_", 1)
                lower, upper = float(lo), float(hi)
            else:
                upper, lower = float(text), None
        except ValueError:
            raise ValueError(f"{key}={spec!r} is neither a number nor 'lo_hi' (e.g. 2.0 or '0.5_5.0')") from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"{key}={spec!r}: bounds must be positive")
    if lower is not None and lower > upper:
        raise ValueError(f"{key}={spec!r}: the lower bound exceeds the upper bound")
    return upper, lower


def parse_rs_options(spec: str) -> list[str]:
    """`rollout_rs` -> its options; several may be chained with commas ("token_k1,seq_max_k2")."""
    options: list[str] = []
    for part in spec.split(","):
        opt = part.strip()
        if not opt:
            continue
        if opt not in ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"algorithm.rollout_correction.rollout_rs: unknown option {opt!r}; choose from {', '.join(ROLLOUT_RS_OPTIONS)}"
            )
        if opt not in options:
            options.append(opt)
    if not options:
        raise ValueError("algorithm.rollout_correction.rollout_rs is empty; set it to null or e.g. seq_mean_k1")
    return options


def parse_rs_thresholds(options: list[str], spec: float | str) -> dict[str, tuple[float | None, float]]:
    """`rollout_rs_threshold` -> {option: (lower, upper)} (verl's rules). One entry shared by all
    options or one per option, comma-separated. `*_k1` options bound the ratio pi_rollout/pi_train:
    "lo_hi", or a single `u` meaning [1/u, u]. Other options take one upper bound (lower None)."""
    key = "algorithm.rollout_correction.rollout_rs_threshold"
    if isinstance(spec, bool):
        raise ValueError(f"{key} must be a number or a string, not a boolean")
    raw = [str(spec)] if isinstance(spec, int | float) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(raw) not in (1, len(options)):
        raise ValueError(f"{key}={spec!r}: give one threshold for all options or one per option ({len(options)})")
    if len(raw) == 1:
        raw = raw * len(options)
    out: dict[str, tuple[float | None, float]] = {}
    for opt, text in zip(options, raw, strict=True):
        try:
            if opt.endswith("k1"):
                if "_" in text:
                    lo, hi = text.split("_", 1)
                    lower: float | None = float(lo)
                    upper = float(hi)
                else:
                    upper = float(text)
                    lower = 1.0 / upper if upper > 0 else -1.0
            else:
                if "_" in text:
                    raise ValueError(f"{key}: option {opt} takes a single upper bound, got {text!r}")
                upper, lower = float(text), None
        except ValueError as exc:
            if "single upper bound" in str(exc):
                raise
            raise ValueError(f"{key}: {text!r} is not a number (option {opt})") from None
        if upper <= 0 or (lower is not None and lower <= 0):
            raise ValueError(f"{key}: thresholds for {opt} must be positive, got {text!r}")
        if lower is not None and lower > upper:
            raise ValueError(f"{key}: lower bound exceeds upper bound for {opt} ({text!r})")
        out[opt] = (lower, upper)
    return out


class KLControlConfig(ConfigModel):
    """KL-in-reward controller (verl `algorithm.kl_ctrl`)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed or adaptive coefficient (`adaptive` is refused where `use_kl_in_reward` is on: not
    implemented)."""
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
    """Float: truncated-IS upper clamp (TIS). "lo_hi" string: two-sided mask (IcePop-style),
    whatever `rollout_is_mode` says (as in verl)."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """For a float threshold: `truncate` clamps weights above it (TIS); `mask` zeroes the
    tokens/sequences above it (MIS). A "lo_hi" threshold always masks."""
    rollout_rs: str | None = None
    """Rejection metric(s), comma-separated: token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3,
    seq_max_k2|k3 (verl names); null: none. A token/sequence is kept only if every option passes."""
    rollout_rs_threshold: float | str | None = None
    """Bounds of the rejection metric(s), one shared or one per option (comma-separated). `*_k1`:
    bounds of the ratio pi_rollout/pi_train as "lo_hi", or `u` for [1/u, u]; others: an upper bound."""
    rollout_is_batch_normalize: bool = False
    """Normalize IS weights to mean 1 over the batch."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Bypass-mode policy gradient: `ppo_clip` (ratio to the rollout logprobs; IS weights only
    logged, as in verl) or `reinforce` (-A * w * log pi with detached IS weights w)."""

    @field_validator("rollout_is_threshold")
    @classmethod
    def _is_threshold(cls, value: float | str) -> float | str:
        parse_is_threshold(value)
        return value

    @field_validator("rollout_rs")
    @classmethod
    def _rs_options(cls, value: str | None) -> str | None:
        if value is not None:
            parse_rs_options(value)
        return value

    @model_validator(mode="after")
    def _rs_threshold(self) -> RolloutCorrectionConfig:
        if self.rollout_rs is not None and self.rollout_rs_threshold is None:
            raise ValueError("rollout_rs is set but rollout_rs_threshold is null; set algorithm.rollout_correction.rollout_rs_threshold")
        if self.rollout_rs is not None and self.rollout_rs_threshold is not None:
            parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold)
        if self.loss_type == "reinforce" and not self.bypass_mode:
            raise ValueError(
                "algorithm.rollout_correction.loss_type=reinforce is a bypass-mode loss; set "
                "algorithm.rollout_correction.bypass_mode=true or loss_type=ppo_clip"
            )
        if self.loss_type == "reinforce" and self.rollout_is is not None and self.rollout_is_batch_normalize:
            # bypass mode weighs inside the loss, one micro-batch at a time: a mean over each would
            # make the gradient depend on the micro-batch size (and undo sequence IS at size 1)
            raise ValueError(
                "algorithm.rollout_correction.rollout_is_batch_normalize=true needs the whole batch, which "
                "bypass mode's reinforce loss never sees (it weighs each micro-batch); set "
                "rollout_is_batch_normalize=false, or bypass_mode=false with loss_type=ppo_clip"
            )
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
    """Subtract kl_ctrl.kl_coef * KL(pi_old || reference) from each response token's reward (verl
    `apply_kl_penalty`, before the rollout correction and the advantages); builds the reference
    policy (`actor_rollout_ref.ref`) as `use_kl_loss` does."""
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl"] = "kl"
    """KL estimator for the in-reward penalty."""
    kl_ctrl: KLControlConfig = KLControlConfig()
    """KL-in-reward controller."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Off-policy corrections."""
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    """DAPO dynamic sampling."""

    @model_validator(mode="after")
    def _kl_ctrl(self) -> AlgorithmConfig:
        if self.use_kl_in_reward and self.kl_ctrl.type != "fixed":
            raise ValueError(
                "algorithm.kl_ctrl.type=adaptive is not implemented (its coefficient would have to live in "
                "the checkpoint); set algorithm.kl_ctrl.type=fixed with the kl_coef you want"
            )
        return self


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
