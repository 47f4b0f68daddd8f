"""Proto <-> Python for the param server's own messages (manifests and refs: services/weights/convert.py)."""

from __future__ import annotations

from meshrl.v1 import param_server_pb2

from .store import StoredVersion


def version_info(stored: StoredVersion, now: float) -> param_server_pb2.VersionInfo:
    m = stored.manifest
    return param_server_pb2.VersionInfo(
        policy_version=m.policy_version,
        total_bytes=m.total_bytes,
        holders=stored.live_holders(now) + stored.readers,
        created_unix_s=m.created_unix_s,
    )
