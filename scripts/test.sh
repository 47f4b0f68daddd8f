#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the default test suite (unit, integration, e2e).
# Extra arguments go to pytest, e.g. scripts/test.sh -m unit
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
export MESHRL_REQUIRE_BUF=${MESHRL_REQUIRE_BUF:-$([ -x node_modules/.bin/buf ] && echo 1 || echo 0)}
exec python -m pytest "$@"
