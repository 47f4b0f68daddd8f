#!/usr/bin/env bash
# Weight sync from every rank between nodes on a many-core host (issue 21, item 2), where the
# 2-core sandbox's CPUs cap the links it can shape: `meshrl bench weights-sharded --backend gloo
# --cross-node --link-mbit X`, 4 rollout ranks, S = 1, 2, 4 trainer ranks, each rank in a network
# namespace of its own behind a link of X Mbit/s. Needs root, iproute2 and tc (says so and exits 0
# without them). LINK_MBIT (default 4000), SIZE_GB (default 0.5), SENDERS (default "1 2 4").
# Writes $OUT/sharded_crossnode_S.json and summary_crossnode.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/meshrl-gpu-out}
mkdir -p "$OUT"
SITE=/tmp/site
PY=${PYTHON:-python3}
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "sharded_crossnode: needs root, ip and tc (uid $(id -u); ip: $(command -v ip); tc: $(command -v tc)): skipped" \
    | tee "$OUT/summary_crossnode.txt"
  exit 0
fi
. scripts/gpu/ray_site.sh
ray_site "$PY" "$SITE" "$OUT/pip.log"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
export PYTHONUNBUFFERED=1 MESHRL_LOG_FORMAT=console MESHRL_LOG_LEVEL=WARNING
status=0
for s in ${SENDERS:-1 2 4}; do
  timeout "${CASE_TIMEOUT_S:-170}" "$PY" -m meshrl.cli bench weights-sharded --backend gloo --cross-node \
    --link-mbit "${LINK_MBIT:-4000}" --size-gb "${SIZE_GB:-0.5}" --bucket-mb 64 --rounds 3 --senders "$s" \
    --receivers 4 --out "$OUT/sharded_crossnode_$s.json" > "$OUT/sharded_crossnode_$s.stdout" 2>&1 \
    || { status=1; tail -20 "$OUT/sharded_crossnode_$s.stdout"; }
done
"$PY" - "$OUT" <<'PY' | tee "$OUT/summary_crossnode.txt"
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("sharded_crossnode_*.json")):
    r = json.loads(f.read_text())
    c, q = r["cases"], r["ratios"]
    print(f"S={r['senders']} R={r['receivers']} link {r['placement']['link_mbit']} Mbit/s, line rate {r['line_rate_s']} s:",
          ", ".join(f"{k} {c[k]['median_s']} s" for k in c),
          f"| over line rate: rank0 {q['rank0_median_over_line_rate']}, sharded {q['sharded_median_over_line_rate']}",
          f"| speed-up {q['sharded_vs_rank0_speedup_median']} (+gather {q['sharded_vs_rank0_plus_gather_speedup_median']})")
PY
exit $status
