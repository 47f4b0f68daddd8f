#!/usr/bin/env bash
# Issue 21, items 8 and 3 on a 2-GPU host: seconds from `meshrl train` to the first optimizer step
# (the built-in example, its warm start carried in .wheels/warm/, rollout on one GPU and the rank
# on the other, nccl weight sync), every application at once against one at a time
# (`serve.parallel_deploy=false`) in the same call; then the nccl transport against a raw
# broadcast at several bucket sizes. Self-contained on the GPU host: Ray Serve from .wheels/ray.
#
#   (GPU host) OUT=/dir scripts/gpu/startup.sh        # carry [".wheels/ray", ".wheels/warm"]
#
# Writes $OUT/env.txt, $OUT/steps.txt, $OUT/startup.json (per run: time to the first step and
# summary.json's startup_s with every process's timeline), $OUT/weights.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
OUT=${OUT:-/tmp/meshrl-startup}
W=${MESHRL_WORK:-/tmp/meshrl-startup-work}
SITE=/tmp/site
PY=${PYTHON:-python3}
rm -rf "$W"
mkdir -p "$OUT" "$SITE" "$W"
say() { echo "[+$(($(date +%s) - START))s] $*" | tee -a "$OUT/steps.txt"; }
. scripts/gpu/ray_site.sh
ray_site "$PY" "$SITE" "$W/install.log"
# What `pip install` does and the bundle's --no-compile skipped: byte-compile once, so the
# measured start-up is not every fresh process compiling Ray's and meshrl's sources at once.
"$PY" -m compileall -q -j 0 "$SITE" services meshrl > /dev/null 2>&1
say "installed and compiled"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MESHRL_LOG_LEVEL=WARNING
warm=$PWD/$(ls -d .wheels/warm/*/ | head -1)
{ "$PY" -c "import torch, ray; print('torch', torch.__version__, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], 'ray', ray.__version__)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; echo "cpus $(nproc)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

run() {  # run NAME OVERRIDES...: one case, alone on the host, stopped 15 s after its first step
  local name=$1 t0
  shift
  t0=$(date +%s)
  timeout -k 10 150 "$PY" -m meshrl.cli bench e2e "actor_rollout_ref.model.path=$warm" trainer.device=cuda \
    rollout_worker.device=cuda serve.rollout.num_gpus=1 actor_rollout_ref.rollout.checkpoint_engine.backend=nccl \
    trainer.test_freq=-1 trainer.val_before_train=false trainer.save_freq=-1 "$@" ${MESHRL_STARTUP_OVERRIDES:-} --modes fully_async --no-baseline \
    --max-train-s 15 --run-root "$W/runs/$name" --label "$name" --out "$W/$name.json" > "$W/$name.log" 2>&1
  say "$name: rc=$? wall=$(($(date +%s) - t0))s"
}
# Delta sync (issue 21, item 4): "whole_lrX" (bf16 rollout, whole versions) and "delta_lrX" (the
# same with param_server.delta_sync) at learning rate X; their weights/* numbers land in delta.json.
for r in ${MESHRL_STARTUP_RUNS:-at_once_1 one_at_a_time at_once_2 one_at_a_time_2 at_once_3}; do
  case $r in
    one_at_a_time*) run "$r" serve.parallel_deploy=false ;;
    whole_lr*) run "$r" actor_rollout_ref.rollout.dtype=bfloat16 "actor_rollout_ref.actor.optim.lr=${r#whole_lr}" ;;
    delta_lr*) run "$r" actor_rollout_ref.rollout.dtype=bfloat16 "actor_rollout_ref.actor.optim.lr=${r#delta_lr}" \
                 param_server.delta_sync=true ;;
    *) run "$r" ;;
  esac
done
"$PY" - "$W/runs" > "$OUT/delta.json" <<'PYEOF'
import json, pathlib, statistics, sys
out = {}
for run in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    roll = [json.loads(x) for f in run.rglob("metrics/rollout.jsonl") for x in f.read_text().splitlines() if x]
    train = [json.loads(x) for f in run.rglob("metrics/trainer.jsonl") for x in f.read_text().splitlines() if x]
    by_v = {int(r["rollout/weights/delta_version"]): r for r in roll if "rollout/weights/delta_version" in r}
    deltas = [r for v, r in sorted(by_v.items()) if r["rollout/weights/delta_base_version"] == v - 1]
    pub = [t["timing_s/publish"] for t in train if "timing_s/publish" in t]
    out[run.name] = {
        "steps": len(train), "publish_s_median": statistics.median(pub) if pub else None,
        "rollout_versions_sampled": len(by_v), "delta_versions_sampled": len(deltas),
        "sent_fraction": [round(r["rollout/weights/sent_fraction"], 4) for r in deltas],
        "changed_fraction": [round(r.get("rollout/weights/changed_fraction", 0.0), 4) for r in deltas],
        "whole_bytes": deltas[0]["rollout/weights/whole_bytes"] if deltas else None,
        "weight_load_s_median": statistics.median(r["rollout/weight_load_s"] for r in roll) if roll else None,
    }
print(json.dumps(out, indent=1))
PYEOF
"$PY" - "$W" > "$OUT/startup.json" <<'PYEOF'
import json, pathlib, sys
out = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    try:
        d = json.loads(f.read_text())
    except ValueError:
        continue
    for name, c in d.get("cases", {}).items():
        out[f.stem] = {"to_first_step_s": c.get("startup_s"), "first_step_done_s": c.get("first_step_done_s"), "steps": c.get("steps"), "per_step_s": c.get("per_step_s"),
                       "audit_balanced": c.get("audit_balanced"), "phases": c.get("startup_phases_s")}
print(json.dumps(out, indent=1))
PYEOF
"$PY" -c "
import json, sys
for n, c in json.load(open(sys.argv[1])).items():
    p = {k: v for k, v in (c['phases'] or {}).items() if k != 'timeline'}
    print(n, 'to first step', c['to_first_step_s'], 's; steps', c['steps'], 'audit', c['audit_balanced'], p)
" "$OUT/startup.json" | tee -a "$OUT/steps.txt"

for mb in ${MESHRL_BUCKETS_MB:-512 2048 4096}; do
  timeout -k 10 150 "$PY" -m meshrl.cli bench weights --size-gb 8 --bucket-mb "$mb" --rounds 6 --transports nccl \
    --out "$W/w_nccl_$mb.json" > "$W/w_nccl_$mb.log" 2>&1
  say "nccl bucket ${mb} MiB: rc=$? $("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get('ratios') or d.get('targets')))" "$W/w_nccl_$mb.json" 2>&1 | tail -1)"
done
"$PY" - "$W" > "$OUT/weights.json" <<'PYEOF'
import json, pathlib, sys
print(json.dumps({f.stem: json.loads(f.read_text()) for f in sorted(pathlib.Path(sys.argv[1]).glob("w_nccl_*.json"))}, indent=1))
PYEOF
tail -30 "$W"/*.log > "$OUT/logs_tail.txt" 2>/dev/null
say "done"
