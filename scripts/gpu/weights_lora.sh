#!/usr/bin/env bash
# Bytes and seconds per weight version on the GPU machine, full weights vs the LoRA adapter alone,
# for the 25M model of the GPU benchmarks (qwen3_small, fp32; `meshrl bench weights --model`):
# nccl (trainer rank 0 on GPU 0 -> a rollout rank on GPU 1, through a param server here), grpc and
# disk (host memory, as the trainer exports). object_store needs Ray: not run here. Every fetched
# version is checked byte for byte, and the adapter's manifest names its base.
#
#   (here)       pip download --no-deps peft==0.21.2 accelerate==1.15.0 -d .wheels/lora   # carry [".wheels"]
#   (GPU host)   OUT=/some/dir scripts/gpu/weights_lora.sh          # ~1 minute
#
# Writes $OUT/env.txt, $OUT/weights_lora_r8.json, $OUT/weights_lora_r32.json, $OUT/summary.txt.
# Pure-Python packages the image lacks (peft, accelerate, pydantic & co) are installed from any
# wheel directory under .wheels/ into /tmp/site, as scripts/gpu/weights.sh does.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/meshrl-gpu-lora}
mkdir -p "$OUT"
SITE=/tmp/site
mkdir -p "$SITE"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MESHRL_LOG_FORMAT=console MESHRL_LOG_LEVEL=WARNING RAY_USAGE_STATS_ENABLED=0

mods=(numpy pydantic structlog yaml google.protobuf grpc transformers safetensors peft)
missing=()
for mod in "${mods[@]}"; do "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod"); done
if [ ${#missing[@]} -gt 0 ] && ls -d .wheels/*/ >/dev/null 2>&1; then
  links=()
  for d in .wheels/*/; do links+=(--find-links "$d"); done
  for pkg in typing_extensions annotated_types typing_inspection pydantic_core pydantic structlog pyyaml \
             packaging psutil accelerate peft; do
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${links[@]}" "$pkg" 2>/dev/null || true
  done
  missing=()
  for mod in "${mods[@]}"; do "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod"); done
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "missing Python modules: ${missing[*]} (carry .wheels/ with their wheels; see the header)" | tee "$OUT/summary.txt"
  exit 2
fi
{
  "$PY" --version
  "$PY" -c "import torch, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], 'peft', peft.__version__)"
  nvidia-smi --query-gpu=name,memory.total --format=csv
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
for rank in 8 32; do
  "$PY" -m meshrl.cli bench weights --model qwen3_small --lora-rank "$rank" --rounds 3 --bucket-mb 256 \
    --transports nccl,grpc,disk --out "$OUT/weights_lora_r$rank.json" > "$OUT/weights_lora_r$rank.stdout" 2>&1 \
    || { status=1; tail -30 "$OUT/weights_lora_r$rank.stdout"; }
done

"$PY" - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("weights_lora_r*.json")):
    r = json.loads(f.read_text())
    sizes = {k: v["bytes"] for k, v in r["versions"].items()}
    print(f"{f.name}: {r['model']} rank {r['lora_rank']}, bytes {sizes} "
          f"ratio {r['bytes_ratio_full_over_lora']} target met {r['targets']['lora_bytes_ge_20x_fewer']['met']}")
    for t, v in r["transports"].items():
        if "error" in v:
            print(f"  {t}: ERROR {v['error']}")
            continue
        for kind in r["versions"]:
            c = v[kind]
            key = "end_to_end" if "end_to_end" in c else "broadcast"
            print(f"  {t} {kind}: median {c[key]['median_s']} s (cold {c[key]['cold_s']} s), verified {c.get('verified')}")
PY
exit $status
