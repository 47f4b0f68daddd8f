#!/usr/bin/env bash
# The nccl transport inside a real `meshrl train` on 2 GPUs: the built-in example (its warm start
# carried in .wheels/warm/), the rollout replica on one GPU, the trainer's rank on the other, weights
# broadcast GPU to GPU every step (announce through CommitVersion, then the trainer's re-commit).
# Self-contained on the GPU host: Ray Serve from .wheels/ray (shared/tools/gpu-bundle.sh), pydantic &
# co from .wheels/lora.
#
#   (here)     shared/tools/gpu-bundle.sh .wheels/ray; cp -r ~/.cache/meshrl/tiny-qwen3-addition2-* .wheels/warm/
#   (GPU host) OUT=/dir scripts/gpu/nccl_train.sh        # ~2-3 minutes; carry [".wheels"]
#
# Writes $OUT/env.txt, $OUT/train.log (tail), $OUT/summary.json, $OUT/result.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/meshrl-nccl-train}
W=${MESHRL_WORK:-/tmp/meshrl-nccl-train-work}
SITE=/tmp/site
mkdir -p "$OUT" "$SITE" "$W"
PY=${PYTHON:-python3}
if ! "$PY" -c "import ray.serve" 2>/dev/null; then
  tar -xJf .wheels/ray/ray_slim.tar.xz -C "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels/ray/*.whl 2>&1 | tail -2
fi
# the tarball drops exec bits (gcs_server, raylet)
[ -d "$SITE/ray/core/src" ] && find "$SITE/ray/core/src" -type f ! -name "*.py" -exec chmod +x {} +
for pkg in typing_extensions annotated_types typing_inspection pydantic_core pydantic pyyaml; do
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" --find-links .wheels/lora "$pkg" 2>/dev/null || true
done
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
warm=$(ls -d .wheels/warm/*/ | head -1)
{ "$PY" -c "import torch, ray; print('torch', torch.__version__, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], 'ray', ray.__version__)"; nvidia-smi --query-gpu=name,memory.total --format=csv; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout "${MESHRL_TRAIN_CAP_S:-360}" "$PY" -m meshrl.cli train "actor_rollout_ref.model.path=$PWD/$warm" \
  trainer.device=cuda rollout_worker.device=cuda serve.rollout.num_gpus=1 \
  actor_rollout_ref.rollout.checkpoint_engine.backend=nccl rollout.total_rollout_steps="${MESHRL_PROMPTS:-3200}" \
  trainer.test_freq=-1 trainer.val_before_train=false --no-report --run-dir "$W/run" > "$W/train.log" 2>&1
rc=$?
tail -60 "$W/train.log" > "$OUT/train.log"
cp "$W/run/summary.json" "$OUT/" 2>/dev/null
grep -h '"weights_published"\|weights_loaded\|CommitVersion\|error' "$W"/run/logs/*.jsonl 2>/dev/null | tail -20 > "$OUT/logs_tail.txt"
"$PY" - "$OUT" "$rc" <<'PY' | tee "$OUT/result.txt"
import json, pathlib, sys
out, rc = pathlib.Path(sys.argv[1]), sys.argv[2]
s = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
print("rc", rc, "steps", s.get("steps"), "policy_versions", s.get("policy_versions"), "wall_s", s.get("wall_s"),
      "reward first/last 10%", s.get("reward_first_10pct"), s.get("reward_last_10pct"), "audit", s.get("audit"),
      "failure", s.get("failure"))
PY
