"""What the publish-side fingerprint costs the object_store transport (diagnostic, not a mode of
the product): `meshrl bench weights --size-gb 0.5 --transports object_store` run `pairs` times
as shipped and `pairs` times with the bucket fingerprint replaced by a constant, alternated, in
one process. The fingerprint is what a remote consumer checks its pulled copy against, and the
manifest's checksum (a version's identity at the param server) covers it: the product always
computes it. Prints one JSON line per run (memcpy, steady publish / fetch ms, the target's ratio).
Needs Ray. Usage: PYTHONPATH=. python scripts/gpu/objstore_fp_cost.py [pairs]"""

from __future__ import annotations

import json
import sys

from meshrl.bench import weights as bench
from services.weights.transports import object_store as osm


async def _no_fingerprint(nbytes: int, arrays: list, threads: int = 1) -> str:
    return "0" * 32


def main(pairs: int = 3) -> None:
    shipped = osm._fingerprint
    for i in range(2 * pairs):
        variant = "shipped" if i % 2 == 0 else "no_fingerprint"
        osm._fingerprint = shipped if variant == "shipped" else _no_fingerprint  # type: ignore[assignment]
        r = bench.run_benchmark(size_gb=0.5, transports=("object_store",))
        t = r["transports"]["object_store"]
        if "error" in t:
            print(json.dumps({"variant": variant, "error": t["error"]}), flush=True)
            continue
        steady = t["rounds"][1 + t.get("warmup_rounds", 0):]
        print(json.dumps({
            "variant": variant, "memcpy_ms": round(r["baselines"]["memcpy"]["best_s"] * 1e3, 1),
            "publish_ms": [round(x["publish"] * 1e3, 1) for x in steady],
            "fetch_ms": [round(x["fetch"] * 1e3, 1) for x in steady],
            "ratio_best": r["targets"]["object_store_ge_50pct_memcpy"]["ratio_best"],
            "ratio_median": r["targets"]["object_store_ge_50pct_memcpy"]["ratio_median"],
        }), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
