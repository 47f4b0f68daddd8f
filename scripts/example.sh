#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the built-in example: `meshrl train` with no config
# (GRPO on two-digit addition with a tiny Qwen3, warm-started by `meshrl pretrain` on first use,
# all five services on a local Ray Serve, fully async). Extra arguments go to `meshrl train`,
# e.g. `scripts/example.sh --mode sync` or `scripts/example.sh trainer.seed=1`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
exec meshrl train "$@"
