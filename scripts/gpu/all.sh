#!/usr/bin/env bash
# Runs ON a 2-GPU machine (Python 3.12 with torch + transformers, no Ray, no registry): every GPU
# suite of meshrl in one go, within a wall-clock budget, so that one device call gives all results.
#
#   OUT=/some/dir scripts/gpu/all.sh            # MESHRL_GPU_BUDGET_S=540 by default
#
# Wheels: the pure-Python packages the image lacks (pydantic & co, structlog, megatron-core) are
# installed from .wheels/megatron (scripts/gpu/fetch_wheels.sh) into /tmp/site. grpcio, protobuf
# and pytest are the image's own (the generated stubs in meshrl/v1 match its grpcio).
#
# Order (two lanes at once, then the transport benchmark alone on a quiet machine):
#   lane A  scripts/gpu/megatron.sh (megatron engine vs transformers / fsdp; xdist -n 4 if present)
#   lane B  tests/unit/test_algos_gpu.py, scripts/gpu/trainer.sh (fsdp), scripts/gpu/rollout.sh
#   then    scripts/gpu/weights.sh (NCCL param-server test, `meshrl bench weights` 8 GiB + 1 GiB)
# Each step has a time cap, cut to what is left of the budget; a step that would get < 20 s is
# skipped and says so. MESHRL_GPU_SKIP="megatron weights" (names: megatron algos trainer rollout
# weights) leaves steps out, e.g. to rerun only what failed. Writes $OUT/summary.txt (per step: exit status, wall time, pytest's last
# line) and $OUT/results.tgz (every log, junit XML and JSON).
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
DEADLINE=$((START + ${MESHRL_GPU_BUDGET_S:-540}))
OUT=${OUT:-/tmp/meshrl-gpu-all}
W=${MESHRL_GPU_WORK:-/tmp/meshrl-gpu-work}
rm -rf "$W"
mkdir -p "$W" "$OUT"
PY=${PYTHON:-python3}
export PYTHON="$PY"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 MESHRL_LOG_FORMAT=console

SITE=/tmp/site
mkdir -p "$SITE"
WHEELS=${MESHRL_GPU_WHEELS:-.wheels/megatron}
wheels=()
for w in typing_extensions annotated_types typing_inspection pydantic_core pydantic structlog packaging megatron_core; do
  f=$(ls "$WHEELS"/"$w"-[0-9]*.whl 2>/dev/null | head -1)
  if [ -n "$f" ]; then wheels+=("$f"); else echo "no wheel for $w in $WHEELS" | tee -a "$W/steps.txt"; fi
done
[ ${#wheels[@]} -gt 0 ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
  > "$W/install.log" 2>&1 || echo "pip install of the wheels failed (see install.log)" | tee -a "$W/steps.txt"
export PYTHONPATH="$SITE"

{
  date -u
  "$PY" --version
  "$PY" -c "import torch, transformers, grpc, google.protobuf as p, pydantic, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]); print('transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', p.__version__, 'pydantic', pydantic.__version__, 'megatron-core', m.__version__)"
  "$PY" -c "import xdist; print('pytest-xdist', xdist.__version__)" 2>&1 | tail -1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m 2>/dev/null | head -4
  echo "cpus $(nproc)"
} > "$W/env.txt" 2>&1
cat "$W/env.txt"

step() {  # step NAME CAP_S COMMAND...: run with a time cap (cut to the budget left), log to $W/NAME.log
  local name=$1 cap=$2
  shift 2
  if [[ " ${MESHRL_GPU_SKIP:-} " == *" $name "* ]]; then
    echo "$name: SKIPPED (MESHRL_GPU_SKIP)" | tee -a "$W/steps.txt"
    return 0
  fi
  local left=$((DEADLINE - $(date +%s)))
  local t=$((cap < left ? cap : left))
  if [ "$t" -lt 20 ]; then
    echo "$name: SKIPPED (only ${left}s of the budget left)" | tee -a "$W/steps.txt"
    return 0
  fi
  local t0
  t0=$(date +%s)
  echo "[$((t0 - START))s] start $name (cap ${t}s)"
  timeout -k 15 "$t" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  local last
  last=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected).* in [0-9.]+s' "$W/$name.log" | tr -d '=' | tail -1)
  local note=""
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && note=" TIMED OUT at ${t}s"
  echo "$name: rc=$rc wall=$(($(date +%s) - t0))s (started at +$((t0 - START))s)$note | $last" | tee -a "$W/steps.txt"
}

xdist=()
"$PY" -c "import xdist" 2>/dev/null && xdist=(-n 4)

( mkdir -p "$W/megatron"; OUT="$W/megatron" step megatron 420 bash scripts/gpu/megatron.sh "${xdist[@]}" ) &
lane_a=$!

mkdir -p "$W/algos" "$W/rollout"
step algos 120 "$PY" -m pytest -m gpu tests/unit/test_algos_gpu.py -q -rfEs -p no:cacheprovider -o addopts="" \
  --junitxml="$W/algos/junit.xml"
step trainer 240 bash scripts/gpu/trainer.sh
OUT="$W/rollout" step rollout 200 bash scripts/gpu/rollout.sh

wait "$lane_a"
mkdir -p "$W/weights"
OUT="$W/weights" step weights 240 bash scripts/gpu/weights.sh

{
  echo "# meshrl GPU suites, $(date -u +%F), total wall $(($(date +%s) - START))s"
  cat "$W/env.txt"
  echo
  cat "$W/steps.txt"
  echo
  for f in "$W"/megatron/pytest.log "$W"/algos.log "$W"/trainer.log "$W"/rollout.log "$W"/weights/pytest.log; do
    [ -f "$f" ] && { echo "--- ${f#"$W"/}: results"; grep -E '(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)' "$f" | grep -v '^\[' | head -40; }
  done
  echo
  [ -f "$W/megatron.log" ] && { echo "--- megatron numbers"; sed -n '/^dense_\|^moe_\|^mini_\|^megatron_vs_fsdp/p' "$W/megatron.log"; }
  [ -f "$W/weights/summary.txt" ] && { echo "--- weights"; cat "$W/weights/summary.txt"; }
  [ -f "$W/rollout/rollout_gpu_bench.json" ] && { echo "--- rollout bench"; "$PY" -c "import json,sys; d=json.load(open(sys.argv[1]))['transformers']; print({k: d[k] for k in ('engine_tokens_per_s', 'generate_tokens_per_s', 'ratio', 'target_ratio') if k in d})" "$W/rollout/rollout_gpu_bench.json"; }
} > "$OUT/summary.txt" 2>&1
tar czf "$OUT/results.tgz" -C "$W" .
cat "$OUT/summary.txt"
