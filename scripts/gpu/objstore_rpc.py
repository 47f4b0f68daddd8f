"""What the object_store transport's two control calls cost (diagnostic, not a benchmark): a
round trip to a Serve deployment through a DeploymentHandle (what `ServeDirectory.register` and
`.lookup` make) against the same round trip to a plain Ray actor, each carrying what a 0.5 GiB
version's registration carries (a ~2 KiB manifest and two bucket refs, nested so they stay refs).
Interleaved over rounds; prints one JSON line per variant (best / median ms). Needs Ray Serve.

    PYTHONPATH=$PWD python scripts/gpu/objstore_rpc.py [rounds]
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

from services.common.serve_util import init_ray


class Directory:
    """Keeps (manifest, refs) per version, as the param server's store does for object_store."""

    def __init__(self) -> None:
        self.versions: dict[int, tuple[bytes, list[Any]]] = {}

    async def register(self, version: int, manifest: bytes, refs: list[Any]) -> int:
        self.versions[version] = (manifest, refs)
        self.versions.pop(version - 2, None)
        return len(manifest)

    async def lookup(self, version: int) -> tuple[bytes, list[Any]]:
        return self.versions[version]


async def main(rounds: int) -> None:
    import ray
    from ray import serve

    init_ray(num_cpus=min(8, os.cpu_count() or 2))
    serve.start()
    handle = serve.run(serve.deployment(Directory, name="Directory", max_ongoing_requests=64).bind(),
                       name="directory", route_prefix=None)
    actor = ray.remote(Directory).options(num_cpus=0).remote()  # type: ignore[attr-defined]
    manifest = os.urandom(2048)
    times: dict[str, list[float]] = {k: [] for k in ("serve_register", "serve_lookup", "actor_register", "actor_lookup")}
    for r in range(rounds + 3):
        refs = [ray.put(os.urandom(64)), ray.put(os.urandom(64))]
        for kind in (("serve", "actor") if r % 2 == 0 else ("actor", "serve")):
            target = handle if kind == "serve" else actor  # both answer `.method.remote(...)`, awaitable
            t0 = time.perf_counter()
            await target.register.remote(r, manifest, refs)
            t1 = time.perf_counter()
            _, got = await target.lookup.remote(r)
            t2 = time.perf_counter()
            assert len(got) == 2
            if r >= 3:  # the first rounds warm the router and the actor's worker
                times[f"{kind}_register"].append(t1 - t0)
                times[f"{kind}_lookup"].append(t2 - t1)
    for k, xs in times.items():
        print(json.dumps({"variant": k, "rounds": len(xs), "best_ms": round(min(xs) * 1e3, 2),
                          "median_ms": round(statistics.median(xs) * 1e3, 2), "cpus": os.cpu_count()}), flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 40))
