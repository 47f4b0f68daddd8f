#!/usr/bin/env bash
# The host transports on the GPU machine (item 3 of issue 21: "meet both targets here and on the GPU
# host"): `meshrl bench weights --size-gb 0.5 --transports grpc,object_store`, the command of the
# 2-core target, three times, against a host memcpy measured in each run. Needs Ray: the Ray Serve
# bundle carried in .wheels/ray (shared/tools/gpu-bundle.sh), installed into /tmp/site.
# BASE=path/to/tree.tar (`git archive REV`, carried): each run of this tree is preceded by one of
# that tree (objstore_base_N.json), for an A/B in one call.
# Writes to $OUT: env.txt, objstore_N.json (objstore_base_N.json), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/meshrl-gpu-out}
mkdir -p "$OUT"
SITE=/tmp/site
PY=${PYTHON:-python3}
. scripts/gpu/ray_site.sh
ray_site "$PY" "$SITE" "$OUT/pip.log"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
export PYTHONUNBUFFERED=1 MESHRL_LOG_FORMAT=console MESHRL_LOG_LEVEL=WARNING RAY_USAGE_STATS_ENABLED=0
{ "$PY" --version; nproc; free -g | head -2; df -h /dev/shm | tail -1; lscpu | grep -i "model name\|L3"; } > "$OUT/env.txt" 2>&1
status=0
if [ -n "${BASE:-}" ]; then
  rm -rf /tmp/meshrl-base && mkdir -p /tmp/meshrl-base && tar -xf "$BASE" -C /tmp/meshrl-base
fi
for i in 1 2 3; do
  if [ -n "${BASE:-}" ]; then
    (cd /tmp/meshrl-base && PYTHONPATH="/tmp/meshrl-base:$SITE" "$PY" -m meshrl.cli bench weights --size-gb 0.5 \
      --transports grpc,object_store --out "$OUT/objstore_base_$i.json" > "$OUT/objstore_base_$i.stdout" 2>&1) \
      || { status=1; tail -30 "$OUT/objstore_base_$i.stdout"; }
  fi
  "$PY" -m meshrl.cli bench weights --size-gb 0.5 --transports grpc,object_store --out "$OUT/objstore_$i.json" \
    > "$OUT/objstore_$i.stdout" 2>&1 || { status=1; tail -30 "$OUT/objstore_$i.stdout"; }
done
"$PY" - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("objstore_*.json")):
    r = json.loads(f.read_text())
    t = r["transports"]
    row = [f.name, f"memcpy {r['baselines']['memcpy']['best_GBps']} GB/s"]
    for name in ("grpc", "object_store"):
        v = t.get(name, {})
        if "error" in v:
            row.append(f"{name} ERROR {v['error']}")
            continue
        row.append(name + " " + " ".join(f"{k} {v[k]['median_GBps']} ({v[k]['best_GBps']}) GB/s {v[k]['best_s']} s"
                                         for k in ("publish", "fetch", "end_to_end") if k in v))
    row.append(json.dumps(r["targets"]))
    print("\n  ".join(row))
PY
exit $status
