"""Environments of multi-turn trajectories: the `Environment` contract (base.py), verl-compatible
tools and interactions (tools.py, tool_env.py), external EnvironmentService endpoints (client.py)
and the plain server that hosts one (core.py, servicer.py, server.py)."""
