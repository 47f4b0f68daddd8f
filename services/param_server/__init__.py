"""The param_server service."""

# The config tree imports services.param_server.config; load it first so that importing any module of
# this package on its own (services.param_server.config included) does not hit a circular import.
import services.common.config  # noqa: F401
