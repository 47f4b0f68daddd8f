"""Build a param server (store + servicer) from a MeshConfig."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from services.common.config import MeshConfig
from services.common.config.param_server import ParamServerConfig
from services.common.logging import get_logger
from services.weights.transports.disk import disk_dir, version_dir

from .servicer import ParamServerServicer
from .store import StoredVersion, StoreSettings, WeightStore

log = get_logger(__name__)
MiB = 1 << 20


def physical_memory_bytes() -> int:
    """This host's RAM (1 TiB when the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def store_settings(cfg: ParamServerConfig) -> StoreSettings:
    return StoreSettings(
        retain_versions=cfg.retain_versions,
        hold_ttl_s=cfg.hold_ttl_s,
        stall_timeout_s=cfg.stall_timeout_s,
        sha256=cfg.bucket_sha256,
        pool_max_bytes=cfg.pool_max_mb * MiB,
        max_upload_bytes=cfg.max_upload_mb * MiB if cfg.max_upload_mb else physical_memory_bytes(),
        max_holders_per_version=cfg.max_holders_per_version,
    )


def evict_disk_versions(root: Path | None):  # type: ignore[no-untyped-def]
    """An eviction hook that deletes a `disk` version's directory (only ever under `root`)."""

    def on_evict(stored: StoredVersion) -> None:
        if root is None or "disk" not in stored.manifest.transports:
            return
        path = version_dir(root, stored.policy_version)
        if path.resolve().parent == root.resolve() and path.exists():
            shutil.rmtree(path, ignore_errors=True)
            log.info("disk_version_deleted", policy_version=stored.policy_version, path=str(path))

    return on_evict


def build_servicer(
    cfg: MeshConfig | ParamServerConfig,
    run_dir: str | os.PathLike[str] | None = None,
    *,
    address: str = "",
) -> ParamServerServicer:
    ps = cfg.param_server if isinstance(cfg, MeshConfig) else cfg
    try:
        root: Path | None = disk_dir(ps, run_dir)
    except ValueError:
        root = None
    store = WeightStore(store_settings(ps), on_evict=evict_disk_versions(root))
    return ParamServerServicer(
        store,
        address=address,
        chunk_bytes=ps.chunk_mb * MiB,
        max_message_bytes=ps.max_message_mb * MiB,
        transfer_timeout_s=ps.transfer_timeout_s,
        stall_timeout_s=ps.stall_timeout_s,
        max_concurrent_uploads=ps.max_concurrent_uploads,
    )
