#!/usr/bin/env bash
# Issue 21 on a 4-GPU machine: weight sync (rank 0 vs every rank, nccl vs a raw broadcast, the host
# transports) and a GPU workload where RL does the work (configs/bench/e2e_learn.yaml), several
# seeds and modes at once. Self-contained on the GPU host (Python 3.12 + torch + transformers, no
# Ray, no registry): installs the Ray Serve bundle from .wheels/ray (shared/tools/gpu-bundle.sh).
#
#   OUT=/dir PHASES="weights warmstart" scripts/gpu/issue21.sh      # call 1: measure, calibrate
#   OUT=/dir PHASES="e2e" MESHRL_STOP_LOSS=0.6 scripts/gpu/issue21.sh   # call 2: the runs
#   # item 1 as measured on 2026-11-28 (4 GPUs, carry .wheels/ray and .wheels/warm): the built-in example,
#   # 3 modes x 3 seeds at once, 1000 steps each (BENCHMARKS.md, "Issue 21 on H100s (2026-11-28)")
#   OUT=/dir MESHRL_CONFIG=meshrl/configs/example.yaml MESHRL_WARM=$PWD/.wheels/warm/tiny-qwen3-addition2-d2eeda7212c0 \
#     PHASES=e2e MESHRL_TRAIN_S=330 MESHRL_OVERRIDES="rollout.total_rollout_steps=32000 trainer.test_freq=-1 \
#     trainer.save_freq=-1 trainer.val_before_train=false" MESHRL_RUNS="fully_async:0:0,1 fully_async:1:2,3 \
#     fully_async:2:1,0 one_step_off:0:3,2 one_step_off:1:0,1 one_step_off:2:2,3 sync:0:1,0 sync:1:3,2 sync:2:0,1" \
#     scripts/gpu/issue21.sh
#
# Phases
#   weights    `meshrl bench weights-sharded` (2 trainer ranks -> 2 rollout ranks, GPUs 0-3),
#              `meshrl bench weights --transports nccl` (GPU 0 -> GPU 1, 8 GiB) and the host
#              transports (grpc, object_store: 0.5 GiB), each against its baseline in the same run
#   warmstart  one SFT warm start per stop loss in MESHRL_STOP_LOSSES (in parallel, one GPU each),
#              then the sampled reward of each (one step of the plain loop: 256 samples at T=1)
#   probe      MESHRL_PROBES ("LR:GPUS[:OVERRIDE] ...") fully_async runs of MESHRL_PROBE_S seconds each, at once
#   e2e        MESHRL_RUNS ("MODE:SEED:GPUS ...") at once, each `meshrl bench e2e` in its own
#              process and Ray with CUDA_VISIBLE_DEVICES=GPUS (rollout on one, the rank on the other),
#              stopped MESHRL_TRAIN_S seconds after its first step
# Everything lands in $OUT (<= 8 files): steps.txt, env.txt, summary.txt, weights.json, e2e.json,
# curves.json (reward, entropy, KL per step, per case), results.tgz (logs, per-case JSON, metrics).
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
DEADLINE=$((START + ${MESHRL_BUDGET_S:-570}))
OUT=${OUT:-/tmp/meshrl-issue21}
W=${MESHRL_WORK:-/tmp/meshrl-issue21-work}
PY=${PYTHON:-python3}
PHASES=${PHASES:-weights warmstart}
CONFIG=${MESHRL_CONFIG:-configs/bench/e2e_learn.yaml}  # MESHRL_WARM: a warm start to use as is (no SFT here)
# MESHRL_DEVICE=cpu (with MESHRL_ARCH=qwen3, the 0.8M tiny model) is the local smoke form: gloo
# instead of nccl, no GPUs to share out.
DEVICE=${MESHRL_DEVICE:-cuda}
# MESHRL_MAX_DIGITS: the longest string of the task (the warm start and the runs alike)
MAXD=${MESHRL_MAX_DIGITS:-32}
TASK_OVR=()
[ -n "${MESHRL_MAX_DIGITS:-}" ] && TASK_OVR=(data.synthetic.max_digits=$MAXD)
SFT="--task copy --arch ${MESHRL_ARCH:-qwen3_small} --digits 4 --length-tail-alpha 1.5 --max-digits $MAXD --batch-size 128 --lr 1e-3 --warmup-steps 100 --steps 1500 --device $DEVICE"
DEV_OVR=(trainer.device=$DEVICE rollout_worker.device=$DEVICE "${TASK_OVR[@]}")
if [ "$DEVICE" = cuda ]; then DEV_OVR+=(serve.rollout.num_gpus=1); else DEV_OVR+=(actor_rollout_ref.rollout.checkpoint_engine.backend=gloo); fi
rm -rf "$W"
L=$W/logs
mkdir -p "$W" "$L" "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 MESHRL_LOG_LEVEL=${MESHRL_LOG_LEVEL:-WARNING}
export MESHRL_CACHE_DIR=${MESHRL_CACHE_DIR:-$W/cache}
say() { echo "[+$(($(date +%s) - START))s] $*" | tee -a "$OUT/steps.txt"; }
left() { echo $((DEADLINE - $(date +%s))); }

SITE=/tmp/site
. scripts/gpu/ray_site.sh
ray_site "$PY" "$SITE" "$L/install.log" && export PATH="$SITE/bin:$PATH"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  "$PY" -c "import torch, transformers, grpc, ray; print('torch', torch.__version__, 'gpus', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'ray', ray.__version__)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m 2>/dev/null | head -6
  echo "cpus $(nproc)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
say "installed; phases: $PHASES"

capped() {  # capped NAME CAP_S COMMAND...: under min(cap, budget left) seconds, logged to $L/NAME.log
  local name=$1 cap=$2 l t rc t0
  shift 2
  l=$(left); t=$((cap < l ? cap : l))
  if [ "$t" -lt 20 ]; then say "$name: SKIPPED (${l}s left)"; return 99; fi
  t0=$(date +%s)
  timeout -k 10 "$t" "$@" > "$L/$name.log" 2>&1
  rc=$?
  say "$name: rc=$rc wall=$(($(date +%s) - t0))s$([ $rc -eq 124 ] && echo ' TIMED OUT')"
  [ "$rc" -ne 0 ] && tail -15 "$L/$name.log"
  return "$rc"
}

pretrain() {  # pretrain STOP_LOSS GPU -> prints the checkpoint directory
  CUDA_VISIBLE_DEVICES=$2 capped "pretrain_$1" 200 "$PY" -m meshrl.cli pretrain $SFT --stop-loss "$1" >&2
  grep -E '^/' "$L/pretrain_$1.log" | tail -1
}

# A case: its own process and Ray on two GPUs; `bench e2e --no-baseline` stops it cleanly.
CASE_INDEX=${MESHRL_CASE_BASE:-0}  # set by the caller per case; MESHRL_CASE_BASE: apart from another instance's (a case runs in a subshell: it cannot count for itself)
run_case() {  # run_case NAME GPUS CAP_S MODE TRAIN_S CKPT OVERRIDES...
  local name=$1 gpus=$2 cap=$3 mode=$4 train_s=$5 ckpt=$6
  shift 6
  # Ports of its own per case: cases start at once, and a check-then-bind of the default ports
  # races; below the ephemeral range and above Ray's worker ports (10002-19999).
  local ports=("serve.http_port=$((21000 + CASE_INDEX))" "serve.grpc_port=$((22000 + CASE_INDEX))"
               "param_server.port=$((23000 + CASE_INDEX))")
  CUDA_VISIBLE_DEVICES=$gpus capped "e2e_$name" "$cap" "$PY" -m meshrl.cli bench e2e --config "$CONFIG" \
    "actor_rollout_ref.model.path=$ckpt" "${DEV_OVR[@]}" "${ports[@]}" "$@" \
    --run-root "$W/runs/$name" --modes "$mode" --no-baseline --max-train-s "$train_s" --label "$name" \
    --target-reward 0.85 --targets 0.5,0.6,0.7,0.75,0.8,0.85,0.9 --window 10 --out "$L/e2e_$name.json"
}

warmstart() {  # one warm start per stop loss, in parallel on the GPUs, then each one's sampled reward
    local i=0 pids=()
    local gpus=(${MESHRL_SFT_GPUS:-0 1 2 3})
    for sl in ${MESHRL_STOP_LOSSES:-0.3 0.5 0.8}; do
      local g=${gpus[$((i % ${#gpus[@]}))]}
      ( ck=$(pretrain "$sl" "$g")
        [ -n "$ck" ] && CUDA_VISIBLE_DEVICES=$g capped "eval_$sl" 120 "$PY" -m meshrl.cli bench e2e --config "$CONFIG" \
          "actor_rollout_ref.model.path=$ck" trainer.device=$DEVICE rollout_worker.device=$DEVICE "${TASK_OVR[@]}" serve.http_port=$((24000 + i + ${MESHRL_CASE_BASE:-0})) \
          serve.grpc_port=$((25000 + i + ${MESHRL_CASE_BASE:-0})) param_server.port=$((26000 + i + ${MESHRL_CASE_BASE:-0})) \
          --modes "" --max-train-s 1 --run-root "$W/runs/eval_$sl" --out "$L/eval_$sl.json" ) &
      pids+=($!)
      i=$((i + 1))
    done
    wait "${pids[@]}"
    for sl in ${MESHRL_STOP_LOSSES:-0.3 0.5 0.8}; do
      "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); c=d['cases']['plain']; print('warm start stop_loss', sys.argv[2], 'sampled reward (256 samples, T=1)', round(c['reward_first_10pct'], 3))" \
        "$L/eval_$sl.json" "$sl" 2>/dev/null | tee -a "$OUT/steps.txt"
      grep -E "pretrain_stop_loss" "$L/pretrain_$sl.log" | tail -1 | tee -a "$OUT/steps.txt"
    done
  # the strongest warm start whose sampled reward is still <= 0.5 (else the weakest)
  MESHRL_STOP_LOSS=$("$PY" - "$L" ${MESHRL_STOP_LOSSES:-0.3 0.5 0.8} <<'PYEOF'
import json, pathlib, sys
L, losses = pathlib.Path(sys.argv[1]), sys.argv[2:]
r = {}
for sl in losses:
    try:
        r[sl] = json.loads((L / f"eval_{sl}.json").read_text())["cases"]["plain"]["reward_first_10pct"]
    except (OSError, KeyError, ValueError):
        pass
ok = [sl for sl in losses if sl in r and r[sl] <= 0.5]
print(min(ok, key=float) if ok else max(losses, key=float))
PYEOF
)
  export MESHRL_STOP_LOSS
  say "warm start for the runs: stop loss $MESHRL_STOP_LOSS"
}

for phase in $PHASES; do
  case $phase in
  weights)
    if [ "$DEVICE" != cuda ]; then
      capped w_sharded 170 "$PY" -m meshrl.cli bench weights-sharded --backend gloo --size-gb 0.01 --bucket-mb 4 \
        --rounds 1 --out "$L/w_sharded.json"
    else
    capped w_sharded 170 "$PY" -m meshrl.cli bench weights-sharded --size-gb 4 --bucket-mb 512 --rounds 4 \
      --out "$L/w_sharded.json"
    capped w_nccl 150 "$PY" -m meshrl.cli bench weights --size-gb 8 --bucket-mb 512 --rounds 4 --transports nccl \
      --out "$L/w_nccl.json"
    fi
    # the host transports use no GPU: the warm starts train meanwhile (phase warmstart, if asked for)
    capped w_host 120 "$PY" -m meshrl.cli bench weights --size-gb 0.5 --bucket-mb 256 --rounds 3 \
      --transports grpc,object_store --out "$L/w_host.json" &
    host_pid=$!
    if [[ " $PHASES " == *" warmstart "* ]]; then warmstart; WARM_DONE=1; fi
    wait $host_pid
    "$PY" - "$L" > "$OUT/weights.json" <<'PYEOF'
import json, pathlib, sys
L = pathlib.Path(sys.argv[1])
print(json.dumps({n: json.loads((L / f"{n}.json").read_text()) for n in ("w_sharded", "w_nccl", "w_host")
                  if (L / f"{n}.json").exists()}, indent=1))
PYEOF
    ;;
  cputests)  # the new CPU code paths (gloo), on this host's cores, while the GPUs work
    ( timeout 300 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/unit/test_weights_shards.py \
        tests/unit/test_algos_mismatch.py tests/unit/test_algos_losses.py tests/unit/test_plan_sync.py \
        tests/integration/test_param_server_collective_sharded.py \
        "tests/integration/test_bench_weights.py::test_bench_weights_sharded_runs_every_case_on_gloo" \
        > "$OUT/cpu_tests.log" 2>&1; echo "cpu tests rc=$?" >> "$OUT/cpu_tests.log"
      # the collective transport inside a training run, on CPU (gloo: the nccl code path), logs at INFO
      CUDA_VISIBLE_DEVICES= MESHRL_LOG_LEVEL=INFO timeout 300 "$PY" -m meshrl.cli bench e2e --config "$CONFIG" \
        trainer.device=cpu rollout_worker.device=cpu actor_rollout_ref.rollout.checkpoint_engine.backend=gloo \
        --modes fully_async --no-baseline --max-train-s 40 --run-root "$W/runs/gloo_probe" \
        --out "$L/gloo_probe.json" > "$L/gloo_probe.log" 2>&1; echo "gloo probe rc=$?" >> "$OUT/cpu_tests.log" ) &
    ;;
  sharded)  # the 4-GPU weight-sync comparison alone
    capped w_sharded 170 "$PY" -m meshrl.cli bench weights-sharded --size-gb 4 --bucket-mb 512 --rounds 4 \
      --out "$L/w_sharded.json"
    cp "$L/w_sharded.json" "$OUT/weights_sharded.json" 2>/dev/null
    ;;
  warmstart)
    [ -z "${WARM_DONE:-}" ] && warmstart
    ;;
  probe|e2e)
    ck=${MESHRL_WARM:-$(pretrain "${MESHRL_STOP_LOSS:-0.5}" "${MESHRL_SFT_GPUS%% *}")}
    if [ -n "${MESHRL_WARM:-}" ]; then  # its sampled reward at the start, beside the runs (256 samples, T=1)
      CUDA_VISIBLE_DEVICES=${MESHRL_SFT_GPUS%% *} capped eval_warm 120 "$PY" -m meshrl.cli bench e2e --config "$CONFIG" \
        "actor_rollout_ref.model.path=$ck" trainer.device=$DEVICE rollout_worker.device=$DEVICE --modes "" --max-train-s 1 \
        --run-root "$W/runs/eval_warm" --out "$L/eval_warm.json" &
    fi
    [ -z "$ck" ] && { say "no warm start"; continue; }
    pids=()
    if [ "$phase" = probe ]; then
      for p in ${MESHRL_PROBES:-1e-4:0,1 2e-4:2,3:serve.parallel_deploy=false}; do  # LR:GPUS[:OVERRIDE]
        IFS=: read -r lr gpus extra <<< "$p"  # OVERRIDE: several joined by '+'
        CASE_INDEX=$((CASE_INDEX + 1))
        run_case "probe_d${MAXD}_lr$lr${extra:+_$CASE_INDEX}" "$gpus" $((${MESHRL_PROBE_S:-120} + 150)) fully_async "${MESHRL_PROBE_S:-120}" "$ck" \
          "actor_rollout_ref.actor.optim.lr=$lr" ${extra:+${extra//+/ }} ${MESHRL_OVERRIDES:-} &
        pids+=($!)
      done
    else
      for r in ${MESHRL_RUNS:-fully_async:0:0,1 sync:0:2,3 one_step_off:0:1,2}; do  # MODE:SEED:GPUS[:TAG]
        IFS=: read -r mode seed gpus tag <<< "$r"
        variant=MESHRL_VARIANT_${tag:-none}  # TAG: the overrides in MESHRL_VARIANT_TAG, case MODE_sSEED_TAG
        # shellcheck disable=SC2086
        CASE_INDEX=$((CASE_INDEX + 1))
        MESHRL_LOG_LEVEL=$([ -n "$tag" ] && echo INFO || echo "$MESHRL_LOG_LEVEL") \
        run_case "${mode}_s$seed${tag:+_$tag}" "$gpus" $((${MESHRL_TRAIN_S:-300} + 170)) "$mode" "${MESHRL_TRAIN_S:-300}" "$ck" \
          "trainer.seed=$seed" "data.seed=$seed" ${MESHRL_OVERRIDES:-} ${!variant:-} &
        pids+=($!)
      done
    fi
    wait "${pids[@]}"
    ;;
  esac
done

wait  # the CPU tests, if they still run
jsons=("$L"/e2e_*.json)
if [ -e "${jsons[0]}" ]; then
  "$PY" -m meshrl.cli bench e2e --merge "${jsons[@]}" --out "$OUT/e2e.json" > /dev/null || say "merge failed"
  "$PY" - "$W/runs" "$OUT/curves.json" <<'PYEOF'
import json, pathlib, sys
# Per case: every 5th step's reward, entropy, PPO KL and the split mismatch (trainer metrics).
keys = ["critic/rewards/mean", "actor/entropy", "actor/ppo_kl", "actor/grad_norm", "response_length/mean",
        "rollout_corr/engine_mismatch_kl", "rollout_corr/offpolicy_kl", "rollout_corr/engine_token_fraction",
        "staleness/mean"]
out = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*/*/metrics/trainer.jsonl")):
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    if not recs:
        continue
    t0 = recs[0]["time"] - recs[0].get("timing_s/step", 0)
    out[f.parent.parent.parent.name] = [{"step": r["step"], "t": round(r["time"] - t0, 2),
                                         **{k: round(r[k], 5) for k in keys if r.get(k) is not None}}
                                        for r in recs[::5]]
pathlib.Path(sys.argv[2]).write_text(json.dumps(out))
PYEOF
  "$PY" - "$OUT/e2e.json" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for name, c in sorted(d["cases"].items()):
    print(f"== {name}: steps {c['steps']} per_step {c['per_step_s']}s startup {c.get('startup_s')}s "
          f"reward first10% {c['reward_first_10pct']:.3f} last10% {c['reward_last_10pct']:.3f}")
    print("   time_to_targets_s", c["time_to_targets_s"])
    print("   staleness", c.get("staleness_histogram"), "audit_balanced", c.get("audit_balanced"))
PYEOF
fi
for f in "$L"/w_*.json; do [ -e "$f" ] && "$PY" -c "
import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], json.dumps(d.get('ratios') or d.get('targets')))" "$f" | tee -a "$OUT/summary.txt"; done
tar czf "$OUT/results.tgz" -C "$W" --exclude='checkpoints' --exclude='hf_export' --exclude='cache' . 2>/dev/null
say "done (total $(($(date +%s) - START))s)"
