#!/usr/bin/env bash
# Create .venv and install meshrl with its dev tools and the experiment trackers, pinned by
# requirements/cpu.txt. Idempotent: a second run only checks that everything is in place.
# Quiet: pip's output goes to .venv/setup.log and is shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
log=.venv/setup.log
stamp=.venv/.meshrl-installed
want=$(cat pyproject.toml requirements/cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off

step() {  # step "what" cmd...: run quietly, show the log's tail if it fails
  local what=$1
  shift
  echo "setup: $what"
  if ! "$@" >>"$log" 2>&1; then
    echo "setup: FAILED: $what; the last lines of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  : >"$log"
  echo "setup: installing into .venv (first run: a few minutes; details in $log)"
  step "pip" python -m pip install -q --upgrade pip
  # torch first and exactly pinned: the CPU wheel (a looser pin pulls a multi-GB CUDA build).
  step "torch (CPU)" python -m pip install -q -c requirements/cpu.txt torch==2.13.0
  step "meshrl and its dev tools" python -m pip install -q -c requirements/cpu.txt -e '.[dev,megatron,trackers,lora]'
  # swanlab declares protobuf<7; meshrl's generated code needs protobuf 7, on which swanlab runs
  # (its other requirements came with the `swanlab` extra above).
  step "swanlab (without its protobuf pin)" python -m pip install -q --no-deps -c requirements/cpu.txt swanlab
  echo "$want" > "$stamp"
  echo "setup: done"
fi
# buf (protobuf lint) comes from npm, pinned in package.json.
if command -v npm >/dev/null 2>&1 && [ ! -x node_modules/.bin/buf ]; then
  npm install --no-audit --no-fund --silent >/dev/null 2>&1 || echo "warning: npm install failed; buf lint will be skipped" >&2
fi
