#!/usr/bin/env bash
# --long-prefill-token-threshold on a served stack: for each threshold (0: off), a local
# stack of one decode instance that prefills (`pdserve up --prefill 0 --decode 1`) and the
# same seeded workload through `pdserve bench serve`: prompts of 100-1,945 tokens
# (--random-input-len 1024 --random-range-ratio 0.9), 64 output tokens, Poisson arrivals.
#   bash scripts/bench_long_prefill.sh [RATE] [THRESHOLD ...]     # default: 1.0 req/s; 0 256
# Writes docs/bench/long_prefill_<threshold>.json and prints each report.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-1.0}
shift || true
thresholds=("${@:-0}")
[ $# -gt 0 ] || thresholds=(0 256)
mkdir -p docs/bench
for threshold in "${thresholds[@]}"; do
  log=$(mktemp)
  .venv/bin/pdserve up --prefill 0 --decode 1 --long-prefill-token-threshold "$threshold" \
    --log-level WARNING >"$log" 2>&1 &
  up=$!
  trap 'kill $up 2>/dev/null || true' EXIT
  deadline=$((SECONDS + 300))
  until grep -q '^PDSERVE_READY' "$log"; do
    if [ $SECONDS -gt $deadline ] || ! kill -0 $up 2>/dev/null; then cat "$log"; exit 1; fi
    sleep 0.5
  done
  gateway=$(sed -n 's/^PDSERVE_READY gateway=\([^ ]*\).*/\1/p' "$log")
  echo "== --long-prefill-token-threshold $threshold (gateway $gateway)"
  .venv/bin/pdserve bench serve --gateway "$gateway" --dataset-name random --random-input-len 1024 \
    --random-range-ratio 0.9 --random-output-len 64 --num-prompts 60 --request-rate "$rate" --seed 0 \
    --disable-tqdm --json "docs/bench/long_prefill_${threshold}.json"
  kill -TERM $up
  wait $up || true
  trap - EXIT
  rm -f "$log"
done
