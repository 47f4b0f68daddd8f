#!/usr/bin/env bash
# Why a fresh process's torch + transformers imports take 5 + 8-12 s on the GPU host (issue 21,
# item 8): byte-code caches, the filesystem, the CPU; each import timed cold and warm, with and
# without a compiled PYTHONPYCACHEPREFIX; -X importtime's largest entries.
#   (GPU host) OUT=/dir scripts/gpu/import_diag.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/meshrl-import-diag}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
IMP="import torch; from transformers import AutoModelForCausalLM, AutoTokenizer; import transformers.models.qwen3.modeling_qwen3"
t() { local s=$(date +%s%N); "$@" > /dev/null 2>&1; echo "$(( ($(date +%s%N) - s) / 1000000 )) ms"; }
DWB=${PYTHONDONTWRITEBYTECODE:-}
{
  echo "== python"; "$PY" -c "import sys, os, torch, transformers; print(sys.version); print('dont_write_bytecode', sys.flags.dont_write_bytecode, os.environ.get('PYTHONDONTWRITEBYTECODE'), os.environ.get('PYTHONPYCACHEPREFIX')); d=os.path.dirname(transformers.__file__); print('transformers', transformers.__version__, d, 'writable', os.access(d, os.W_OK)); pc=os.path.join(d, '__pycache__'); print('pycache', os.path.isdir(pc), len(os.listdir(pc)) if os.path.isdir(pc) else 0); t=os.path.dirname(torch.__file__); print('torch', torch.__version__, t, 'writable', os.access(t, os.W_OK), 'pycache', os.path.isdir(os.path.join(t,'__pycache__')))"
  echo "== fs"; df -hT "$("$PY" -c 'import torch,os; print(os.path.dirname(torch.__file__))')" /tmp .; mount | grep -E " / | /usr" | head
  echo "== cpu"; lscpu | grep -E "Model name|^CPU\(s\)|MHz|Thread|Socket"; nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null
  echo "== import torch (3x)"; for i in 1 2 3; do t "$PY" -c "import torch"; done
  echo "== torch+transformers model stack (3x)"; for i in 1 2 3; do t "$PY" -c "$IMP"; done
  echo "== -S -c pass / import json"; t "$PY" -c "pass"; t "$PY" -c "import json, asyncio, ssl"
  export PYTHONPYCACHEPREFIX=/tmp/pycache-prefix; unset PYTHONDONTWRITEBYTECODE
  echo "== with PYTHONPYCACHEPREFIX (first fills it, then 2x)"; for i in 1 2 3; do t "$PY" -c "$IMP"; done
  echo "== 6 at once, with the prefix"; s=$(date +%s%N); for i in 1 2 3 4 5 6; do "$PY" -c "$IMP" & done; wait; echo "$(( ($(date +%s%N) - s) / 1000000 )) ms"
  unset PYTHONPYCACHEPREFIX; export PYTHONDONTWRITEBYTECODE=${DWB:-}; [ -n "$PYTHONDONTWRITEBYTECODE" ] || unset PYTHONDONTWRITEBYTECODE
  echo "== 6 at once, without"; s=$(date +%s%N); for i in 1 2 3 4 5 6; do "$PY" -c "$IMP" & done; wait; echo "$(( ($(date +%s%N) - s) / 1000000 )) ms"
} > "$OUT/import_diag.txt" 2>&1
"$PY" -X importtime -c "$IMP" 2> "$OUT/importtime.txt"
PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/pycache-prefix "$PY" -X importtime -c "$IMP" 2> "$OUT/importtime_prefix.txt"
sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -60 > "$OUT/importtime_top.txt"
sort -t'|' -k1.13 -n -r "$OUT/importtime.txt" | head -60 > "$OUT/importtime_self.txt"
cat "$OUT/import_diag.txt"
# Serve's start, split: the controller (and get_proxies) against the proxies' readiness
SITE=/tmp/site; mkdir -p $SITE
. scripts/gpu/ray_site.sh
ray_site "$PY" "$SITE" /tmp/ray_install.log
"$PY" -m compileall -q -j 0 "$SITE" services meshrl > /dev/null 2>&1
for i in 1 2; do
PYTHONPATH="$PWD:$SITE" RAY_USAGE_STATS_ENABLED=0 timeout 120 "$PY" - >> "$OUT/serve_split.txt" 2>&1 <<'PYEOF'
import time
t0 = time.monotonic()
from services.common.serve_util import init_ray, free_port, SERVICER_FUNCTIONS
init_ray(num_cpus=16, log_to_driver=False)
t1 = time.monotonic(); print("init_ray", round(t1 - t0, 2))
from ray.serve._private import api as sapi
from ray.serve.config import HTTPOptions, gRPCOptions
import ray
ctrl, refs = sapi._create_controller_and_proxy_refs(HTTPOptions(port=free_port()), gRPCOptions(port=free_port(), grpc_servicer_functions=SERVICER_FUNCTIONS), None, None, sapi._coerce_controller_options(None), "HeadOnly")
t2 = time.monotonic(); print("controller+get_proxies", round(t2 - t1, 2))
ray.get(refs); t3 = time.monotonic(); print("proxies ready", round(t3 - t2, 2))
ray.shutdown()
PYEOF
done
