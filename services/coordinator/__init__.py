"""The coordinator service."""

# The config tree imports services.coordinator.config; load it first so that importing any module of
# this package on its own (services.coordinator.config included) does not hit a circular import.
import services.common.config  # noqa: F401
