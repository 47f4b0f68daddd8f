#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the built-in example.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
meshrl --help
exec python -m meshrl.demo "$@"
