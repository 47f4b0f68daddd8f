"""The reward service: built-in scorers, custom functions, external RewardService endpoints."""

# The config tree imports services.reward.config; load it first so that importing any module of
# this package on its own (services.reward.config included) does not hit a circular import.
import services.common.config  # noqa: F401
