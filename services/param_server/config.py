"""`param_server.*`: what the param server can be told."""

from __future__ import annotations

from pydantic import Field

from services.common.config.base import ConfigModel


class ParamServerConfig(ConfigModel):
    """Versioned weight store."""

    retain_versions: int = Field(default=2, ge=1)
    """Newest versions kept (plus any version a consumer still holds)."""
    chunk_mb: int = Field(default=4, ge=1)
    """Chunk size of the grpc transport."""
    transfer_timeout_s: float = Field(default=300.0, gt=0)
    """Deadline of one whole transfer (publish or fetch)."""
    disk_dir: str | None = None
    """Shared directory for the `disk` transport; null: `<run_dir>/weights`."""
