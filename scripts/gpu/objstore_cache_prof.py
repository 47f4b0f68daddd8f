"""Can the object_store publish's fingerprint read its bytes from cache? (diagnostic, not a
benchmark). A 0.5 GiB version (two 256 MiB buckets of 32 MiB arrays, as `meshrl bench weights`
lays them out), two streams at once (one per bucket), variants interleaved over rounds:

  put_both        one object per bucket, no fingerprint (the copy alone)
  shipped         one object per bucket, each beside its 4-thread fingerprint (the publisher now)
  arr_put         one object per array, one after the other (the per-put cost)
  arr_then_fp     one object per array, each array fingerprinted right after its put: Ray's copy
                  just read it, so it may still be in the last-level cache
  arr_pipe        the same, the fingerprint of array i beside the put of array i + 1

with a torch memcpy of the same bytes as the yardstick. Prints one JSON line per variant (best /
median ms) and the host's cache sizes. Needs Ray."""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
import threading

import torch
from objstore_prof import run_interleaved  # this directory (sys.path[0] when run as a script)

from meshrl.bench.weights import make_weights
from services.common.serve_util import init_ray
from services.weights.layout import Fingerprinter
from services.weights.transports import object_store as osm


def main(rounds: int = 12) -> None:
    import ray

    print(subprocess.run("lscpu | grep -i 'model name\\|cache'", shell=True, capture_output=True, text=True).stdout,
          flush=True)
    init_ray(num_cpus=4)
    weights = make_weights(512 << 20, 256 << 20)
    buckets = []
    for b in weights:
        pos, arrays = 0, []
        for _, t in b:
            a = t.view(torch.uint8).reshape(-1).numpy()
            arrays.append((pos, a))
            pos += a.nbytes
        buckets.append(arrays)
    nbytes = [sum(a.nbytes for _, a in b) for b in buckets]

    def streams(fn):  # one thread per bucket
        out: list = [None, None]
        th = [threading.Thread(target=lambda b=b: out.__setitem__(b, fn(b))) for b in (0, 1)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        return out

    def shipped(b: int) -> tuple:
        async def go():
            put = asyncio.to_thread(osm._put_bucket, ray, buckets[b])
            return await asyncio.gather(put, osm._fingerprint(nbytes[b], buckets[b], 4))
        return asyncio.run(go())

    def arr_then_fp(b: int) -> tuple:
        fp, refs = Fingerprinter(nbytes[b]), []
        for off, a in buckets[b]:
            refs.append(ray.put([a]))
            fp.update(off, a)
        return refs, fp.hexdigest()

    def arr_pipe(b: int) -> tuple:
        fp, refs, q = Fingerprinter(nbytes[b]), [], queue.Queue()

        def hasher():
            while (item := q.get()) is not None:
                fp.update(*item)
        h = threading.Thread(target=hasher)
        h.start()
        for off, a in buckets[b]:
            refs.append(ray.put([a]))
            q.put((off, a))
        q.put(None)
        h.join()
        return refs, fp.hexdigest()

    src = torch.empty(512 << 20, dtype=torch.uint8).fill_(7)
    dst = torch.empty_like(src).fill_(0)
    variants = {
        "memcpy_torch": lambda: dst.copy_(src),
        "put_both": lambda: streams(lambda b: osm._put_bucket(ray, buckets[b])),
        "shipped": lambda: streams(shipped),
        "arr_put": lambda: streams(lambda b: [ray.put([a]) for _, a in buckets[b]]),
        "arr_then_fp": lambda: streams(arr_then_fp),
        "arr_pipe": lambda: streams(arr_pipe),
    }
    digests: dict[str, list[str]] = {}

    def seen(k: str, r: list) -> None:
        if k in ("shipped", "arr_then_fp", "arr_pipe"):
            digests.setdefault(k, [x[1] for x in r])

    run_interleaved(variants, rounds, seen)
    print(json.dumps({"same_fingerprints": len({json.dumps(v) for v in digests.values()}) == 1}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
