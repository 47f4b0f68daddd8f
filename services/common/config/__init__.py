"""The typed config tree (pydantic v2): YAML + dotted overrides, verl key names.

    cfg = load_config("run.yaml", ["async_training.staleness_threshold=0.5"])
    derive(cfg).max_required_samples
"""

from .loader import dump_config, load_config, parse_override, write_resolved_config
from .root import Derived, MeshConfig, derive, max_required_samples, required_samples

__all__ = [
    "Derived",
    "MeshConfig",
    "derive",
    "dump_config",
    "load_config",
    "max_required_samples",
    "parse_override",
    "required_samples",
    "write_resolved_config",
]
