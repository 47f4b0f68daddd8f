#!/usr/bin/env bash
# Runs ON the GPU machine (2 CUDA devices; Python 3.12 with torch + transformers preinstalled; no
# package registry). Installs megatron-core and any missing pure-Python deps from .wheels/megatron
# (made by scripts/gpu/fetch_wheels.sh) into /tmp/site, then runs the gpu-marked megatron tests
# (each launches `torchrun --nproc-per-node 2` itself; extra arguments go to pytest, e.g. `-n 4` with
# pytest-xdist to run four cases at a time). Results go to $OUT:
#   pytest.log, junit.xml, env.txt and one JSON per case (logprob/entropy/grad-norm differences
#   against transformers, HF round-trip exactness, resume exactness, memory; megatron_vs_fsdp_*.json:
#   the megatron engine against the fsdp engine on CUDA).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/meshrl-gpu-out}
mkdir -p "$OUT"
SITE=/tmp/site
PY=${PYTHON:-python3}  # the GPU image's python3 holds torch; a bare `python` may be absent or another one
WHEELS=.wheels/megatron
mkdir -p "$SITE"
need() {  # need MODULE WHEEL-GLOB: install the wheel only if MODULE does not import already
  if ! "$PY" -c "import $1" 2>/dev/null; then
    for w in $WHEELS/$2; do
      # pip if the image has it; a wheel is a zip of the package, so unzip is the fallback.
      "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$w" 2>/dev/null \
        || "$PY" -m zipfile -e "$w" "$SITE" || echo "install of $w failed" >&2
    done
    "$PY" -c "import $1" 2>/dev/null || echo "warning: $1 still does not import" >&2
  fi
}
export PYTHONPATH="$PWD:$SITE"
need typing_extensions 'typing_extensions-*.whl'
need annotated_types 'annotated_types-*.whl'
need typing_inspection 'typing_inspection-*.whl'
need pydantic_core 'pydantic_core-*.whl'
need pydantic 'pydantic-*.whl'
need structlog 'structlog-*.whl'
need grpc 'grpcio-*.whl'
need google.protobuf 'protobuf-*.whl'
need yaml 'pyyaml-*.whl'
need safetensors 'safetensors-*.whl'
need packaging 'packaging-*.whl'
need iniconfig 'iniconfig-*.whl'
need pluggy 'pluggy-*.whl'
need pytest 'pytest-*.whl'
need pytest_timeout 'pytest_timeout-*.whl'
need megatron.core 'megatron_core-*.whl'
{
  "$PY" --version
  "$PY" -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count()); print('transformers', transformers.__version__); print('megatron-core', m.__version__)"
  "$PY" -c "import transformer_engine" 2>/dev/null && echo "transformer_engine: present" || echo "transformer_engine: absent (local spec)"
  nvidia-smi --query-gpu=name,memory.total --format=csv
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
export MESHRL_GPU_OUT="$OUT" PYTHONUNBUFFERED=1 MESHRL_LOG_FORMAT=console
"$PY" -m pytest -m gpu tests/gpu/test_megatron_gpu.py tests/gpu/test_recipe_minis_gpu.py tests/gpu/test_megatron_vs_fsdp_gpu.py \
  -v -rfEsx -p no:cacheprovider -o addopts="" --junitxml="$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text())
    if f.stem.startswith("megatron_vs_fsdp"):
        keys = ("logprob_max_abs_diff", "entropy_max_abs_diff", "post_train_logprob_max_abs_diff", "export_max_abs_diff")
        print(f.stem, {k: r.get(k) for k in keys}, "grad_norms", r.get("grad_norms"))
        continue
    keys = ("hf_roundtrip_exact", "logprob_max_abs_diff", "entropy_max_abs_diff", "post_train_logprob_max_abs_diff", "resume_loss_diff")
    print(f.stem, {k: r.get(k) for k in keys}, "grad_norms", r.get("grad_norms"), "ref", r.get("ref_grad_norms"))
PY
exit $status
