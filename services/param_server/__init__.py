"""The param_server service."""
