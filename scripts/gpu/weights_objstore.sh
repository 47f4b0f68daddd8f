#!/usr/bin/env bash
# The host transports on the GPU machine (item 3 of issue 21: "meet both targets here and on the GPU
# host"): `meshrl bench weights --size-gb 0.5 --transports grpc,object_store`, the command of the
# 2-core target, three times, against a host memcpy measured in each run. Needs Ray: the Ray Serve
# bundle carried in .wheels/ray (shared/tools/gpu-bundle.sh), installed into /tmp/site.
# RUNS=N (default 3) runs. BASE=path/to/tree.tar (`git archive REV`, carried): each run of this tree is preceded by one of
# that tree (objstore_base_N.json), for an A/B in one call.
# LAYOUTS="packed tensors" (default: packed): each run of this tree once per `--layout`.
# SOURCES="cpu cuda" (default: cpu): packed runs once per `--source-device` (cuda: the exported
# tensors on the GPU, fingerprinted there as the FSDP export does). HOP=1: the first run of this
# tree adds `--hop` (a version from a rank actor: the wire form against torch's pickling).
# Writes to $OUT: env.txt, summary.txt, runs.tgz (objstore_LAYOUT[_SOURCE]_N.json, objstore_base_N.json).
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
for i in $(seq 1 "${RUNS:-3}"); do
  if [ -n "${BASE:-}" ]; then
    (cd /tmp/meshrl-base && PYTHONPATH="/tmp/meshrl-base:$SITE" "$PY" -m meshrl.cli bench weights --size-gb 0.5 \
      --transports grpc,object_store --out "$OUT/objstore_base_$i.json" > "$OUT/objstore_base_$i.stdout" 2>&1) \
      || { status=1; tail -30 "$OUT/objstore_base_$i.stdout"; }
  fi
  for layout in ${LAYOUTS:-packed}; do
    for src in ${SOURCES:-cpu}; do
      [ "$layout" != packed ] && [ "$src" != cpu ] && continue
      name=objstore_${layout}$([ "$src" != cpu ] && echo "_$src")_$i
      hop=$([ "${HOP:-0}" = 1 ] && [ "$i" = 1 ] && [ "$src" = cpu ] && echo --hop)
      "$PY" -m meshrl.cli bench weights --size-gb 0.5 --transports grpc,object_store --layout "$layout" \
        --source-device "$src" $hop --out "$OUT/$name.json" > "$OUT/$name.stdout" 2>&1 \
        || { status=1; tail -30 "$OUT/$name.stdout"; }
    done
  done
done
"$PY" - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("objstore_*.json"), key=lambda p: p.stat().st_mtime):
    r = json.loads(f.read_text())
    o, g = r["transports"].get("object_store", {}), r["targets"].get("grpc_ge_1GBps", {})
    if "rounds" not in o:
        print(f.name, "ERROR", o.get("error"))
        continue
    steady = o["rounds"][-r["rounds"]:]
    tg = r["targets"]["object_store_ge_50pct_memcpy"]
    print(f"{f.name}: memcpy {r['baselines']['memcpy']['best_s'] * 1e3:.1f} ms | object_store publish ms "
          + ", ".join(f"{x['publish'] * 1e3:.1f}" for x in steady) + " | fetch ms "
          + ", ".join(f"{x['fetch'] * 1e3:.1f}" for x in steady)
          + f" | ratio best {tg['ratio_best']} (median {tg['ratio_median']})"
          + (f" | paired median {tg['paired']['ratio_median']} (worst {tg['paired']['ratio_worst']}, best"
             f" {tg['paired']['ratio_best']}; memcpy {tg['paired']['memcpy_ms']} ms)" if "paired" in tg else "")
          + f" | grpc publish/fetch median GB/s {g.get('publish_GBps', {}).get('median')}/{g.get('fetch_GBps', {}).get('median')}"
          + (f" (grpc.aio alone {g['bare_GBps']['publish']['median']}/{g['bare_GBps']['fetch']['median']},"
             f" ratio {g['ratio_to_bare_median']['publish']}/{g['ratio_to_bare_median']['fetch']})" if "bare_GBps" in g else "")
          + (f" | export fingerprint ({r['export']['source_device']}) {r['export']['fingerprint_s'] * 1e3:.1f} ms,"
             f" ratio with it {tg['with_export_fingerprint']['ratio_best']}" if "export" in r else ""))
    if "hop" in r:
        h = r["hop"]
        print(f"  hop: wire {h.get('wire', {}).get('best_s')} s, torch pickle {h.get('torch_pickle', {}).get('best_s')} s,"
              f" put/get {h.get('put_get', {}).get('best_s')} s, speedup {h.get('wire_speedup_vs_torch_pickle')}, error {h.get('error')}")
PY
tar -czf "$OUT/runs.tgz" -C "$OUT" $(cd "$OUT" && ls objstore_*.json objstore_*.stdout 2>/dev/null) && rm -f "$OUT"/objstore_*
exit $status
