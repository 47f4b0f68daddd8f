"""`environment.*`: the settings live in services/common/config/environment.py (the config tree
imports no service code); this is the service's name for them."""

from services.common.config.environment import EnvironmentConfig, EnvironmentEndpointConfig

__all__ = ["EnvironmentConfig", "EnvironmentEndpointConfig"]
