#!/usr/bin/env bash
# Same-host A/B of the start-up (issue 21, item 8): `scripts/gpu/startup.sh`'s run (the built-in
# example on 2 GPUs, nccl weight sync, stopped 15 s after its first step) from a base tree and
# from this tree, alternating, PAIRS times, new first.
#   (GPU host, 2 GPUs) OUT=/dir BASE=ab_base PAIRS=2 scripts/gpu/startup_ab.sh   # carry [".wheels/ray", ".wheels/warm"]
# MESHRL_STARTUP_OVERRIDES: more config overrides for every run (e.g. a 1-GPU host: both on GPU 0,
#   RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, serve.rollout.num_gpus=0, a host weight transport).
# BASE: an older commit's tree (`git archive COMMIT | tar -x -C ab_base`), travelling untracked.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/meshrl-ab}
BASE=${BASE:-ab_base}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # startup.sh installs the Ray bundle there once
W=/tmp/meshrl-ab-runs  # every run's files; $OUT gets ab.txt, ab.json and the logs' tails
rm -rf "$W"; mkdir -p "$OUT" "$W"
[ -e "$BASE/.wheels" ] || ln -s "$PWD/.wheels" "$BASE/.wheels"
# WARMUP=1: one run of this tree first, not counted (the page cache and, where serve.bytecode_cache
# applies, the byte-code cache are filled by it). FIRST=base: each pair starts with the base.
summary() {
  tail -n 30 "$W"/*.log "$W"/w_*/steps.txt > "$OUT/logs_tail.txt" 2>/dev/null
  python3 - "$W" > "$OUT/ab.json" <<'PYEOF'
import json, pathlib, sys
out = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("w_*/startup.json")):
    out.update(json.loads(f.read_text()))
print(json.dumps(out, indent=1))
PYEOF
}
one() {  # one SIDE I: a run of that tree, its line in ab.txt, the summary so far
  local side=$1 i=$2 tree=$PWD
  [ "$side" = base ] && tree=$PWD/$BASE
  MESHRL_LOG_LEVEL=WARNING MESHRL_STARTUP_RUNS="at_once_${side}_$i" MESHRL_BUCKETS_MB=" " OUT="$W/w_${side}_$i" \
    MESHRL_WORK="/tmp/meshrl-ab-work/${side}_$i" timeout 280 "$tree/scripts/gpu/startup.sh" > "$W/${side}_$i.log" 2>&1
  echo "$side $i rc=$? $(tail -1 "$W/w_${side}_$i/steps.txt" 2>/dev/null)" | tee -a "$OUT/ab.txt"
  summary
}
[ "${WARMUP:-0}" = 1 ] && one new 0
order="new base"; [ "${FIRST:-new}" = base ] && order="base new"
for i in $(seq 1 "${PAIRS:-2}"); do
  for side in $order; do one "$side" "$i"; done
done
