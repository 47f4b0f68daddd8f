"""Where a same-node object_store fetch's milliseconds go (diagnostic, not a benchmark): the param
server app on a local Ray Serve, a 0.5 GiB version (two 256 MiB buckets, as `meshrl bench
weights` lays them out) published each round, then its fetch taken apart step by step: the lookup
(a handle call), the locality check, each bucket's ray.get (in a thread, as the fetcher does), the
manifest check, and the release (the synchronous part of sending it, then its answer); the whole
`ObjectStoreFetcher.fetch` of the same version beside it. Prints best / median ms per step.
Needs Ray. Usage: PYTHONPATH=. python scripts/gpu/objstore_fetch_prof.py [rounds]"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time


def main(rounds: int = 20) -> None:
    import ray
    from ray import serve

    from meshrl.bench.weights import _drain, make_weights
    from services.common.config import MeshConfig
    from services.common.serve_util import APP_LOGGING, init_ray
    from services.param_server.deployment import APP_NAME, build_app
    from services.weights import convert
    from services.weights.transports import object_store as osm

    init_ray(num_cpus=4)
    serve.start(logging_config={"enable_access_log": False, "log_level": "WARNING"})
    cfg = MeshConfig.model_validate({"param_server": {"port": 0, "retain_versions": 1}})
    serve.run(build_app({"config": cfg.model_dump(mode="json")}), name=APP_NAME, route_prefix="/param_server", logging_config=APP_LOGGING)
    weights = make_weights(512 << 20, 256 << 20)
    steps: dict[str, list[float]] = {}

    def note(name: str, t0: float) -> float:
        t1 = time.perf_counter()
        steps.setdefault(name, []).append(t1 - t0)
        return t1

    async def run() -> None:
        directory = osm.ServeDirectory.from_app()
        pub = osm.ObjectStorePublisher(directory)
        fetcher = osm.ObjectStoreFetcher(directory, consumer_id="whole", verify="remote")
        for v in range(1, rounds + 3):
            ref = await pub.publish(v, weights)
            t = time.perf_counter()
            raw, refs = await directory.lookup(v, "steps")
            t = note("lookup", t)
            manifest = convert.manifest_from_proto(raw)
            t = note("manifest_from_proto", t)
            here = osm._put_here(ray, [r[0] for r in refs])
            t = note("put_here", t)
            for i, orefs in enumerate(refs):
                arrays = await asyncio.to_thread(ray.get, list(orefs))
                t = note(f"get_bucket_{i}", t)
                osm._check_arrays(manifest, i, osm._bucket_arrays(arrays), not here[i])
                t = note(f"check_bucket_{i}", t)
                del arrays
            sent = directory.release(v, "steps")
            t = note("release_send", t)
            await sent
            t = note("release_answer", t)
            t0 = time.perf_counter()
            await _drain(fetcher.fetch(ref))
            note("whole_fetch", t0)
            await fetcher.settle()
        await fetcher.close()

    asyncio.run(run())
    for name, xs in steps.items():
        xs = xs[2:]  # the first two rounds warm up
        print(json.dumps({"step": name, "best_ms": round(min(xs) * 1e3, 2),
                          "median_ms": round(statistics.median(xs) * 1e3, 2)}), flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
