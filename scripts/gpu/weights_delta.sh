#!/usr/bin/env bash
# Delta sync on the GPU host (2 CUDA devices; Python 3.12 + torch + grpcio + protobuf + pytest, no
# Ray, no registry): carry .wheels/ray (pydantic, structlog; shared/tools/gpu-bundle.sh).
#   1. the gpu-marked NCCL tests of the collective transport, delta sync's among them: versions
#      rebuilt bit for bit on GPU 1, a drifted copy -> DataLoss, the next version whole;
#   2. `meshrl bench weights-delta`: whole versions vs delta sync, GPU 0 -> GPU 1, the same versions
#      in the same two processes (MESHRL_DELTA_ARGS, default 4 GiB, lr 3e-7 / 1e-6 / 1e-5, 5 rounds),
#      once per link in MESHRL_DELTA_LINKS: "nvlink" (NCCL's default, P2P over NVLink) and "socket"
#      (P2P, shared memory and InfiniBand off, NCCL_NET=Socket: TCP over loopback, the kind of link
#      between nodes without RDMA).
# Writes $OUT/env.txt, pytest.log, weights_delta_<link>.json, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/meshrl-delta}
PY=${PYTHON:-python3}
SITE=/tmp/site
mkdir -p "$OUT"
. scripts/gpu/ray_site.sh
ray_site "$PY" "$SITE" "$OUT/pip.log"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 MESHRL_LOG_FORMAT=console MESHRL_LOG_LEVEL=WARNING
{
  "$PY" -c "import torch; print('torch', torch.__version__, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
  nvidia-smi topo -m 2>/dev/null | head -4
  nproc
} > "$OUT/env.txt" 2>&1
status=0
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/gpu/test_param_server_nccl.py -rfEs \
  > "$OUT/pytest.log" 2>&1 || status=1
tail -3 "$OUT/pytest.log"
for link in ${MESHRL_DELTA_LINKS:-nvlink socket}; do
  env_link=()
  [ "$link" = socket ] && env_link=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket)
  # shellcheck disable=SC2086
  env "${env_link[@]}" timeout 400 "$PY" -m meshrl.cli bench weights-delta \
    ${MESHRL_DELTA_ARGS:---size-gb 4 --lrs 3e-7,1e-6,1e-5 --rounds 5} \
    --out "$OUT/weights_delta_$link.json" > "$OUT/bench_$link.log" 2>&1 || { status=1; tail -30 "$OUT/bench_$link.log"; }
done
"$PY" - "$OUT"/weights_delta_*.json > "$OUT/summary.txt" 2>&1 <<'PY'
import json, sys
for path in sys.argv[1:]:
    r = json.load(open(path))
    print(path.rsplit("/", 1)[-1])
    for name, c in r["cases"].items():
        s = c["sync"]
        print(f"  {name:22s} median {s['median_s']:.4f} s best {s['best_s']:.4f} s cold {s['cold_s']:.4f} s "
              f"identical={c['identical']}" + (f" sent {c['sent_fraction']} changed {c['changed_fraction']}" if "sent_fraction" in c else ""))
    print(json.dumps(r["ratios"]))
PY
cat "$OUT/summary.txt"
exit $status
