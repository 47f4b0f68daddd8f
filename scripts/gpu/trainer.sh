#!/usr/bin/env bash
# The fsdp training engine on CUDA: runs the `gpu`-marked tests of tests/unit/test_fsdp_gpu.py.
# Run on a machine with 1 or 2 CUDA GPUs, from the repo root, with a python that has torch (CUDA
# build) and transformers (the GPU image's python3 does). Missing pure-Python deps are installed
# from .wheels/trainer when present (scripts/gpu/fetch_trainer_wheels.sh fetches them elsewhere).
#
#   scripts/gpu/trainer.sh
#
# Expected on 2 GPUs: "7 passed", or "6 passed, 1 skipped" when flash_attn is not installed (the
# GPU image has none); on 1 GPU the two-device test is skipped as well ("5 passed, 2 skipped").
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
if [ -d .wheels/trainer ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/meshrl-site \
    .wheels/trainer/*.whl
  export PYTHONPATH="/tmp/meshrl-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
"$PY" - <<'PYEOF'
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device visible"
print("gpus:", torch.cuda.device_count(), torch.cuda.get_device_name(0), "torch", torch.__version__,
      "transformers", transformers.__version__)
PYEOF
"$PY" -m pytest -q -p no:cacheprovider -m gpu -o timeout=900 -rs tests/unit/test_fsdp_gpu.py
