#!/usr/bin/env bash
# Create .venv and install meshrl with its dev tools, pinned by requirements/cpu.txt.
# Idempotent: a second run only checks that everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.meshrl-installed
want=$(cat pyproject.toml requirements/cpu.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python -m pip install -q --upgrade pip
  # torch first and exactly pinned: the CPU wheel (a looser pin pulls a multi-GB CUDA build).
  python -m pip install -q -c requirements/cpu.txt torch==2.13.0
  python -m pip install -q -c requirements/cpu.txt -e '.[dev,megatron,lora]'
  echo "$want" > "$stamp"
fi
# buf (protobuf lint) comes from npm, pinned in package.json.
if command -v npm >/dev/null 2>&1 && [ ! -x node_modules/.bin/buf ]; then
  npm install --no-audit --no-fund --silent >/dev/null 2>&1 || echo "warning: npm install failed; buf lint will be skipped" >&2
fi
