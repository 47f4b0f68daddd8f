"""Where the object_store transport's versions live: a plain Ray actor beside the param server's
replica, holding each retained version's manifest and bucket refs.

    publisher ─▶ ObjectRefs.register(manifest, refs)        a plain actor call
              ─▶ the replica's board (register_object_store_version, the manifest only), behind
                 the publish: ListVersions / GetManifest / metrics see the version a moment later
    fetcher   ─▶ ObjectRefs.lookup(version) ─▶ (manifest, refs) ─▶ ray.get (transports/object_store.py)

Why not the replica: a Serve handle call crosses Serve's router and the replica's request path
(3-13 ms on a 2-core host, against 1-4 ms for a plain actor call), and the object_store end to end
is one put, one registration and one lookup. With the calls made here the fetch of 0.5 GiB took
3.6-4.3 ms against 6.2-10.6 ms on a 2-core host, 4.2-4.9 against 5.4-7.1 on a 16-core GPU host
(BENCHMARKS.md, "object_store: the versions' refs in a plain actor"). A lookup also no longer
costs the replica a hold and a release per consumer and version.

Retention: the newest `retain_versions` versions (param_server.retain_versions). Registering one
drops the refs of the older ones at once, in the publish, as the replica's store did: the store
then reuses their shared memory for the next version (a put into fresh pages pays a fault per
page). No hold is taken: a fetch borrows the refs it looked up, so Ray keeps those objects until
the fetch lets them go, whatever this table dropped meanwhile. Besides readers, this table is the
only holder of the refs (the replica's store keeps the manifests alone).

A version is immutable once looked up: the same number with other content is refused then, and
replaces it before (a trainer that died between publish and commit, resumed from a checkpoint,
publishes the same number with other weights; the param server's store has the same rule). A
consumer that loaded the version through the replica's store (AcquireVersion, FetchWeights) makes it
immutable here too: the replica tells this table (`seen`) as the store marks it.

Lifetime: the replica creates the actor on first use, on its own node, and owns it: it dies with
the replica, and the versions with it, as with the store. `ParamServerDeployment.object_refs()`
hands it out and creates a new one if it died; clients ask again once when a call finds it dead
(`ServeDirectory`). This module imports no torch: the actor's process stays small.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound


@dataclass
class _Entry:
    manifest: bytes
    refs: list[Any]
    checksum: str
    served: bool = False


class RefTable:
    """The versions by number, the newest `retain` kept (the actor's state; no Ray here)."""

    def __init__(self, retain: int) -> None:
        if retain < 1:
            raise InvalidArgument("param_server.retain_versions", f"must be >= 1, got {retain}")
        self.retain = retain
        self.versions: dict[int, _Entry] = {}
        self.registered_total = 0
        self.dropped_total = 0

    def register(self, manifest: bytes, refs: list[Any]) -> int:
        """Keep `refs` (one list of object refs per bucket) for the manifest's version; drop what
        retention no longer keeps. Checked before anything changes: a refusal keeps nothing."""
        try:
            m = pb.Manifest.FromString(manifest)
        except DecodeError as exc:
            raise InvalidArgument("manifest", f"not a serialized param_server.v1.Manifest ({exc})") from None
        v = m.policy_version
        if v < 0:
            raise InvalidArgument("manifest.policy_version", f"must be >= 0, got {v}")
        if not m.checksum:
            raise InvalidArgument("manifest.checksum", "empty: build manifests with ManifestBuilder")
        if not isinstance(refs, list) or len(refs) != len(m.buckets):
            got = len(refs) if isinstance(refs, list) else type(refs).__name__
            raise InvalidArgument("refs", f"{got} bucket ref lists for the manifest's {len(m.buckets)} buckets")
        newest = max(self.versions, default=None)
        if newest is not None and v <= newest - self.retain:
            raise FailedPrecondition(
                f"version {v} is older than the {self.retain} retained (newest: {newest}); publish a newer version"
            )
        old = self.versions.get(v)
        if old is not None and old.checksum != m.checksum and old.served:
            raise immutable_refusal(v, old.checksum, m.checksum, [])
        seen = old is not None and old.checksum == m.checksum and old.served  # the same content again: still seen
        self.versions[v] = _Entry(manifest, list(refs), m.checksum, served=seen)
        self.registered_total += 1
        for gone in sorted(self.versions)[: -self.retain]:
            del self.versions[gone]  # the refs go: Ray frees the objects once no reader borrows them
            self.dropped_total += 1
        return v

    def lookup(self, policy_version: int) -> tuple[bytes, list[Any]]:
        """(manifest, bucket refs) of a version; negative: the newest."""
        if policy_version < 0:
            if not self.versions:
                raise NotFound("no version has been published yet")
            policy_version = max(self.versions)
        entry = self.versions.get(policy_version)
        if entry is None:
            raise NotFound(
                f"version {policy_version} is not held (held: {sorted(self.versions)}); it was never published or "
                "was evicted (raise param_server.retain_versions)"
            )
        entry.served = True
        return entry.manifest, entry.refs

    def seen(self, policy_version: int, checksum: str) -> bool:
        """A consumer loaded this version elsewhere (the replica's store: FetchWeights,
        AcquireVersion): from now on it is immutable here too, as after a lookup. Returns whether
        this table holds that content (other content: the store refuses its board post itself)."""
        entry = self.versions.get(policy_version)
        if entry is None or entry.checksum != checksum:
            return False
        entry.served = True
        return True


def immutable_refusal(v: int, old_checksum: str, new_checksum: str, seen_by: list[str]) -> FailedPrecondition:
    """The refusal of other content for a version a consumer has loaded (here and the store's),
    with the way out. A trainer publishes only committed + 1 (the coordinator's CommitVersion takes
    no other number), so "publish a newer version" was advice it could not follow, and each restart
    of the trainer met the same refusal."""
    return FailedPrecondition(
        f"version {v} was already published with different content (checksum {old_checksum[:12]} vs "
        f"{new_checksum[:12]}) and consumers have seen it ({', '.join(seen_by) or 'a consumer'}); versions are "
        f"immutable once seen. If the coordinator's policy_version is {v - 1}, this is the uncommitted version "
        f"of a trainer that died between publish and CommitVersion, loaded meanwhile: restart the param server "
        "(it drops the versions it holds; the trainer publishes again, rollouts keep the weights they loaded), "
        "and have such consumers load versions the coordinator announces, not the newest here. If it is "
        f"already {v} or more, this publisher is stale (another trainer committed {v}): restart the trainer"
    )


class ObjectRefsActor:
    """The RefTable as a Ray actor (`start`): plain methods, one call at a time."""

    def __init__(self, retain: int) -> None:
        self.table = RefTable(retain)

    def register(self, manifest: bytes, refs: list[Any]) -> int:
        return self.table.register(manifest, refs)

    def lookup(self, policy_version: int) -> tuple[bytes, list[Any]]:
        return self.table.lookup(policy_version)

    def seen(self, policy_version: int, checksum: str) -> bool:
        return self.table.seen(policy_version, checksum)

    def stats(self) -> dict[str, Any]:
        t = self.table
        return {"versions": sorted(t.versions), "registered_total": t.registered_total, "dropped_total": t.dropped_total}


def start(retain: int) -> Any:
    """A new ObjectRefsActor on this process's node (the caller owns it: it dies with the caller)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return ray.remote(ObjectRefsActor).options(  # type: ignore[attr-defined]
        num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(retain)
