#!/usr/bin/env bash
# One diagnostic device call (issue 21, items 3 and 8): start-up pieces (scripts/gpu/startup_diag.py),
# one start-up run with Ray's own logs kept, the NCCL transport test, the nccl bench at 512 MiB.
#   (GPU host, 2 GPUs) OUT=/dir scripts/gpu/diag_call.sh      # carry [".wheels/ray", ".wheels/warm"]
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
OUT=${OUT:-/tmp/meshrl-diag}
W=/tmp/meshrl-diag-work
SITE=/tmp/site
PY=${PYTHON:-python3}
rm -rf "$W"; mkdir -p "$OUT" "$SITE" "$W"
say() { echo "[+$(($(date +%s) - START))s] $*" | tee -a "$OUT/steps.txt"; }
. scripts/gpu/ray_site.sh
ray_site "$PY" "$SITE" "$W/install.log"
"$PY" -m compileall -q -j 0 "$SITE" services meshrl tests > /dev/null 2>&1
say "installed and compiled"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
warm=$PWD/$(ls -d .wheels/warm/*/ | head -1)
if [[ " ${PHASES:-diag startup nccltest bench} " == *" diag "* ]]; then
  timeout 240 "$PY" scripts/gpu/startup_diag.py "$warm" > "$OUT/diag.json" 2> "$W/diag.err"; say "diag rc=$?"
fi
if [[ " ${PHASES:-diag startup nccltest bench} " == *" startup "* ]]; then
  MESHRL_LOG_LEVEL=WARNING MESHRL_STARTUP_RUNS="${MESHRL_STARTUP_RUNS:-at_once_1}" MESHRL_BUCKETS_MB=" " OUT="$W/startup" \
    MESHRL_WORK="$W/sw" timeout 300 scripts/gpu/startup.sh > "$W/startup.log" 2>&1
  say "startup rc=$?"; cat "$W/startup/steps.txt" >> "$OUT/steps.txt"; cp "$W/startup/startup.json" "$OUT/" 2>/dev/null
  s=$(ls -td /tmp/ray/session_2* 2>/dev/null | head -1)
  [ -n "$s" ] && tar -czf "$OUT/raylogs.tgz" -C "$s/logs" raylet.out gcs_server.out 2>/dev/null
fi
if [[ " ${PHASES:-diag startup nccltest bench} " == *" nccltest "* ]]; then
  timeout 400 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_param_server_nccl.py -rfEs \
    > "$W/nccltest.log" 2>&1; say "nccl test rc=$? $(tail -1 "$W/nccltest.log")"
  tail -60 "$W/nccltest.log" > "$OUT/nccltest_tail.txt"
fi
if [[ " ${PHASES:-diag startup nccltest bench} " == *" bench "* ]]; then
  for mb in ${MESHRL_BUCKETS_MB:-512}; do
    timeout 150 "$PY" -m meshrl.cli bench weights --size-gb 8 --bucket-mb "$mb" --rounds 6 --transports nccl \
      --out "$W/w_nccl_$mb.json" > "$W/w_nccl_$mb.log" 2>&1
    say "nccl $mb MiB rc=$? $("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get('ratios') or d.get('targets')))" "$W/w_nccl_$mb.json" 2>&1 | tail -1)"
  done
  "$PY" -c "import json,glob; print(json.dumps({f: json.load(open(f)) for f in glob.glob('$W/w_nccl_*.json')}, indent=1))" > "$OUT/weights.json"
fi
tail -40 "$W"/*.log "$W"/startup/*.txt > "$OUT/logs_tail.txt" 2>/dev/null
say "done"
