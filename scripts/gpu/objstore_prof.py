"""Where the object_store publish's time goes on a many-core host (diagnostic, not a benchmark):
Ray puts of a 0.5 GiB version (two 256 MiB buckets of 32 MiB arrays, as `meshrl bench weights`
lays them out) alone, one bucket after the other or both at once, each split into 2 or 4 objects put at once, the bucket fingerprint alone
with 1-16 threads, and both together, interleaved over rounds; a torch memcpy of the same bytes
as the yardstick. Prints one JSON line per variant (best / median ms). Needs Ray."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from meshrl.bench.weights import make_weights
from services.common.serve_util import init_ray
from services.weights.transports import object_store as osm


def main(rounds: int = 12) -> None:
    import ray

    init_ray(num_cpus=4)
    weights = make_weights(512 << 20, 256 << 20)
    buckets = [[(0, t.view(torch.uint8).reshape(-1).numpy()) for _, t in b] for b in weights]
    for b in buckets:  # offsets in layout order
        pos = 0
        for i, (_, a) in enumerate(b):
            b[i] = (pos, a)
            pos += a.nbytes
    nbytes = [sum(a.nbytes for _, a in b) for b in buckets]

    def fp(threads: int, b: int) -> str:
        return asyncio.run(osm._fingerprint(nbytes[b], buckets[b], threads))

    def put(b: int) -> list:
        return osm._put_bucket(ray, buckets[b])

    def both(fns: list) -> list:
        out: list = [None] * len(fns)
        th = [threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, f())) for i, f in enumerate(fns)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        return out

    def groups(b: int, k: int) -> list[list[tuple[int, np.ndarray]]]:
        n = len(buckets[b])
        return [buckets[b][i * n // k:(i + 1) * n // k] for i in range(k)]

    def put_split(k: int, extra: list) -> list:
        """Every bucket as k objects, all puts at once, beside `extra` (fingerprints)."""
        return both([lambda g=g: osm._put_bucket(ray, g) for b in (0, 1) for g in groups(b, k)] + extra)

    src = torch.empty(512 << 20, dtype=torch.uint8).fill_(7)
    dst = torch.empty_like(src).fill_(0)
    variants = {
        "memcpy_torch": lambda: dst.copy_(src),
        "put_seq": lambda: [put(0), put(1)],
        "put_both": lambda: both([lambda: put(0), lambda: put(1)]),
        **{f"fp_{n}thr": (lambda n=n: [fp(n, 0), fp(n, 1)]) for n in (1, 4, 8, 16)},
        **{f"seq_put+fp{n}": (lambda n=n: [both([lambda b=b: put(b), lambda b=b: fp(n, b)]) for b in (0, 1)]) for n in (4, 8)},
        **{f"both_put+fp{n}": (lambda n=n: both([lambda: put(0), lambda: fp(n, 0), lambda: put(1), lambda: fp(n, 1)]))
           for n in (2, 4, 8)},
        **{f"split{k}_put": (lambda k=k: put_split(k, [])) for k in (2, 4)},
        **{f"split{k}_put+fp{n}": (lambda k=k, n=n: put_split(k, [lambda: fp(n, 0), lambda: fp(n, 1)]))
           for k in (2, 4) for n in (4, 8)},
    }
    run_interleaved(variants, rounds)
    ray.shutdown()


def run_interleaved(variants: dict[str, Callable[[], Any]], rounds: int,
                    seen: Callable[[str, Any], None] | None = None) -> None:
    """Every variant once per round, in turn; prints best / median ms per variant, the first two
    rounds left out (warm-up). `seen(name, result)` looks at a result before it is dropped."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, f in variants.items():
            t0 = time.perf_counter()
            r = f()
            times[k].append(time.perf_counter() - t0)
            if seen is not None:
                seen(k, r)
            del r
            time.sleep(0.05)  # the raylet frees released objects every 10 ms (init_ray)
    for k, xs in times.items():
        xs = xs[2:]
        print(json.dumps({"variant": k, "best_ms": round(min(xs) * 1e3, 1),
                          "median_ms": round(statistics.median(xs) * 1e3, 1)}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
