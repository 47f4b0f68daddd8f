#!/usr/bin/env bash
# Rollout on a CUDA GPU: the transformers engine (vLLM has no wheel on the GPU machine).
# Run from anywhere on the GPU machine, in an environment with torch (CUDA build) and meshrl's
# dependencies (e.g. the project's .venv):   scripts/gpu/rollout.sh
# It prints the GPU, runs the `gpu`-marked rollout tests, then `meshrl bench rollout` on CUDA and
# writes the JSON to ${OUT:-/tmp}/rollout_gpu_bench.json. Expected: "N passed" with N = 4 and a
# JSON whose transformers.ratio (slot-refill engine vs model.generate) is > 1.
set -uo pipefail  # the bench runs even when a test fails; the exit status says whether both passed
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RAY_USAGE_STATS_ENABLED=0
"$PY" - <<'PYEOF' || exit 2
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
print("gpu:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PYEOF
status=0
"$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/unit/test_rollout_gpu.py || status=1
OUT_DIR=${OUT:-/tmp}
mkdir -p "$OUT_DIR"
"$PY" -m meshrl.cli bench rollout --engines transformers --device cuda --prompts 128 --slots 128 \
  --out "$OUT_DIR/rollout_gpu_bench.json" || status=1
exit $status
