"""The object_store transport's door onto the store: versions whose buckets are Ray object refs
(the refs stay refs; the store keeps them until retention evicts the version). No Ray here.

Publishers register in the background (`ObjectStorePublisher.publish` returns once the bytes are
in the object store and the registration is on its way, so the registration's round trip overlaps
the consumer's lookup or the trainer's commit). A lookup of a version newer than the newest
registered one may therefore arrive first: it waits for that registration, up to the `wait_s` the
caller gives, then fails NotFound as before. Registration is one synchronous store call, so a
lookup sees a version whole or not at all.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from meshrl.v1 import param_server_pb2 as pb
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.weights import convert
from services.weights.layout import Manifest

from .store import WeightStore

OBJECT_STORE = "object_store"


class ObjectVersions:
    """Register and look up object_store versions in `store` (one event loop: the replica's)."""

    def __init__(self, store: WeightStore, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        # set (and replaced) at every registration: waiting lookups re-check the store
        self._registered = asyncio.Event()

    def register(self, manifest: bytes, refs: list[Any]) -> Manifest:
        """Validate and store the version (all or nothing), wake lookups waiting for it; returns the
        stored manifest."""
        m = convert.manifest_from_proto(pb.Manifest.FromString(manifest))
        stored = self.store.register(m.with_transports([OBJECT_STORE]), self.clock(), payload=list(refs))
        self._registered.set()
        self._registered = asyncio.Event()
        return stored

    async def lookup(self, policy_version: int, consumer_id: str, wait_s: float = 0.0) -> tuple[bytes, list[Any]]:
        """Pin a version for `consumer_id` and return (manifest, bucket refs); negative = newest. A
        version newer than the newest waits up to `wait_s` for its registration."""
        if not isinstance(wait_s, int | float) or not math.isfinite(wait_s) or wait_s < 0:
            raise InvalidArgument("wait_s", f"must be a finite number of seconds >= 0, got {wait_s!r}")
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        while True:
            registered = self._registered  # taken before the check: a registration after it sets this one
            try:
                m = self.store.acquire(consumer_id, policy_version, self.clock())
                break
            except NotFound:
                newest = self.store.newest_version()
                left = end - loop.time()
                if policy_version < 0 or (newest is not None and policy_version <= newest) or left <= 0:
                    raise
                try:
                    await asyncio.wait_for(registered.wait(), timeout=left)
                except TimeoutError:
                    raise NotFound(
                        f"version {policy_version} was not registered within {wait_s:.1f}s (newest: {newest}); "
                        "its publisher's registration failed or never came (see the trainer's next publish)"
                    ) from None
        stored = self.store.get(m.policy_version)
        if not isinstance(stored.payload, list):
            raise FailedPrecondition(
                f"version {m.policy_version} is not in the object store (it travels over {list(m.transports)})"
            )
        return convert.manifest_to_proto(m).SerializeToString(), list(stored.payload)
