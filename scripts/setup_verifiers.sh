#!/usr/bin/env bash
# Build .venv-verifiers: a separate environment with verifiers (prime-rl's environments package,
# PyPI) for examples/verifiers_agent/ and tests/e2e/test_verifiers_gateway.py. Separate because
# verifiers' openai-agents wants websockets<17 while meshrl's main venv pins 17.x; the agent is a
# program meshrl starts (`agent.command`), so it needs only its own packages, not meshrl's.
# Exact pins in requirements/verifiers.txt (no torch). Idempotent: a second run only checks the stamp.
#     scripts/setup_verifiers.sh && .venv-verifiers/bin/python examples/verifiers_agent/evaluate.py --help
set -euo pipefail
cd "$(dirname "$0")/.."
# The repo root on PYTHONPATH (as .ci/run exports it) shows pip the editable meshrl's egg-info,
# whose requirements this venv deliberately lacks: pip check would fail on them.
unset PYTHONPATH
PY=${PYTHON:-python3}
VENV=${MESHRL_VERIFIERS_VENV:-.venv-verifiers}
stamp=$VENV/.meshrl-verifiers-installed
want=$( (cat "$0" requirements/verifiers.txt) | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# --no-deps: the file is the whole resolved set, so nothing outside it can slip in.
pip install -q --no-deps -r requirements/verifiers.txt
pip check
"$VENV/bin/python" -c 'import verifiers as vf, openai; print("verifiers", vf.__version__, "openai", openai.__version__)'
echo "$want" > "$stamp"
