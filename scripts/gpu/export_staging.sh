#!/usr/bin/env bash
# The export's copy from the GPU into host buckets, through the pinned stage (packing.STAGE_BYTES)
# against the direct copy into pageable memory, same process, same tensors, alternated
# (`bench_export`: its `pack_direct_best_s`, `staging_speedup_best`), RUNS times (default 3) at
# 0.5 and 1 GiB; then the GPU tests of the packing and the FSDP export. Needs one GPU. Ray is not
# used, but meshrl's imports want it: the bundle in .wheels/ray is installed into /tmp/site.
# Writes to $OUT: env.txt, export_SIZE_N.json, summary.txt, pytest.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/meshrl-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
. scripts/gpu/ray_site.sh
ray_site "$PY" /tmp/site "$OUT/pip.log"
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
{ "$PY" --version; nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; } > "$OUT/env.txt" 2>&1
status=0
for i in $(seq 1 "${RUNS:-3}"); do
  for gib in 0.5 1; do
    "$PY" -c "
import json, sys
from meshrl.bench.weights_export import bench_export
r = bench_export(int($gib * (1 << 30)), 256 << 20, 'cuda')
json.dump(r, open('$OUT/export_${gib}_$i.json', 'w'))
print('$gib GiB run $i: staged', r['pack_best_s'], 's, direct', r['pack_direct_best_s'], 's, speedup',
      r['staging_speedup_best'], ', copies alone', r['copy_best_s'], 's', flush=True)
" | tee -a "$OUT/summary.txt" || status=1
  done
done
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_weights_packing.py tests/unit/test_fsdp_gpu.py \
  > "$OUT/pytest.txt" 2>&1 || status=1
tail -3 "$OUT/pytest.txt"
exit $status
