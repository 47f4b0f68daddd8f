"""The `megatron` training engine (megatron-core). Importing this package registers
("megatron", "cuda"); it needs `pip install meshrl[megatron]`."""

from .engine import MegatronEngine

__all__ = ["MegatronEngine"]
