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
thresholds=("$@")
[ $# -gt 0 ] || thresholds=(0 256)
mkdir -p docs/bench
. scripts/local_stack.sh
trap stop_stack EXIT
for threshold in "${thresholds[@]}"; do
  start_stack --prefill 0 --decode 1 --long-prefill-token-threshold "$threshold" --log-level WARNING
  echo "== --long-prefill-token-threshold $threshold (gateway $gateway)"
  .venv/bin/pdserve bench serve --gateway "$gateway" --dataset-name random --random-input-len 1024 \
    --random-range-ratio 0.9 --random-output-len 64 --num-prompts 60 --request-rate "$rate" --seed 0 \
    --disable-tqdm --json "docs/bench/long_prefill_${threshold}.json"
  stop_stack
done
