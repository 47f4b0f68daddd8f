"""The reward service: built-in scorers, custom functions, external RewardService endpoints."""
