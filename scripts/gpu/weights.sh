#!/usr/bin/env bash
# Weight transports on the GPU machine (2 CUDA devices; Python 3.12 + torch CUDA + grpcio +
# protobuf; no Ray, no registry). Runs from the repository root of a checkout:
#   1. the gpu-marked NCCL test: trainer rank 0 on GPU 0 -> a rollout rank on GPU 1 through a real
#      param server: bytes identical (bf16/fp32/bool), a corrupted bucket NACKed and re-sent, a
#      stuck sender -> DeadlineExceeded on both sides, the group re-formed for the next version;
#   2. `meshrl bench weights` 8 GiB: the nccl transport vs a raw torch.distributed.broadcast of the
#      same bytes in the same two processes (target: >= 0.8 of the raw broadcast);
#   3. `meshrl bench weights` 1 GiB on this host's CPUs: grpc (loopback, target >= 1 GB/s), disk
#      and gloo against a host memcpy (object_store needs Ray: not run here).
# Writes to $OUT: env.txt, pytest.log, junit.xml, weights_nccl.json, weights_host.json, summary.txt.
# Missing pure-Python packages (pydantic, structlog, pyyaml, pytest, ...) are installed from any
# wheel directory under .wheels/ (carry it: `carry: [".wheels"]`) into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/meshrl-gpu-out}
mkdir -p "$OUT"
SITE=/tmp/site
mkdir -p "$SITE"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 MESHRL_LOG_FORMAT=console MESHRL_LOG_LEVEL=WARNING RAY_USAGE_STATS_ENABLED=0

missing=()
for mod in numpy pydantic structlog yaml pytest google.protobuf grpc; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ] && ls -d .wheels/*/ >/dev/null 2>&1; then
  links=()
  for d in .wheels/*/; do links+=(--find-links "$d"); done
  for pkg in typing_extensions annotated_types typing_inspection pydantic_core pydantic structlog pyyaml \
             packaging iniconfig pluggy pytest pytest_timeout numpy; do
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${links[@]}" "$pkg" 2>/dev/null || true
  done
  missing=()
  for mod in numpy pydantic structlog yaml pytest google.protobuf grpc; do
    "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
  done
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "missing Python modules: ${missing[*]} (carry a .wheels/ directory with their cp312 wheels)" | tee "$OUT/summary.txt"
  exit 2
fi

{
  "$PY" --version
  "$PY" -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]); print('grpcio', grpc.__version__, 'protobuf', p.__version__)"
  nvidia-smi --query-gpu=name,memory.total --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
"$PY" -m pytest -m gpu tests/gpu/test_param_server_nccl.py -v -p no:cacheprovider -o addopts="" \
  --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

"$PY" -m meshrl.cli bench weights --size-gb 8 --bucket-mb 512 --rounds 3 --transports nccl \
  --out "$OUT/weights_nccl.json" > "$OUT/weights_nccl.stdout" 2>&1 || { status=1; tail -30 "$OUT/weights_nccl.stdout"; }
"$PY" -m meshrl.cli bench weights --size-gb 1 --bucket-mb 256 --rounds 2 --transports grpc,disk,gloo \
  --out "$OUT/weights_host.json" > "$OUT/weights_host.stdout" 2>&1 || { status=1; tail -30 "$OUT/weights_host.stdout"; }

"$PY" - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("weights_nccl.json", "weights_host.json"):
    f = out / name
    if not f.exists():
        print(name, "missing")
        continue
    r = json.loads(f.read_text())
    print(f"{name}: {r['bytes'] / 2**30:.0f} GiB, memcpy {r['baselines']['memcpy']['best_GBps']} GB/s")
    for t, v in r["transports"].items():
        if "error" in v:
            print(f"  {t}: ERROR {v['error']}")
            continue
        fields = {k: v[k]["median_GBps"] for k in ("publish", "fetch", "end_to_end", "broadcast") if k in v}
        raw = {k: v[k]["best_GBps"] for k in ("raw_bucketed", "raw_whole") if k in v}
        print(f"  {t}: median GB/s {fields} raw broadcast best GB/s {raw}")
    for k, v in r["targets"].items():
        print(f"  target {k}: {v}")
PY
exit $status
