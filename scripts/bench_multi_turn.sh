#!/usr/bin/env bash
# Multi-turn chat on a colocated stack: two decode instances that prefill every prompt
# themselves (`pdserve up --prefill 0 --decode 2`), one stack per placement policy, the same
# seeded conversations through `pdserve bench multi-turn` (16 conversations x 4 turns, 4
# system prompts of 256 tokens, 32-96 user and 32-64 answer tokens a turn, 4 open at once).
#   bash scripts/bench_multi_turn.sh [POLICY ...]     # default: least_loaded prefix_aware
# Writes docs/bench/multi_turn_<policy>.json and prints each report.
set -euo pipefail
cd "$(dirname "$0")/.."
policies=("$@")
[ $# -gt 0 ] || policies=(least_loaded prefix_aware)
mkdir -p docs/bench
. scripts/local_stack.sh
trap stop_stack EXIT
for policy in "${policies[@]}"; do
  start_stack --prefill 0 --decode 2 --policy "$policy" --log-level WARNING
  echo "== --policy $policy (gateway $gateway)"
  .venv/bin/pdserve bench multi-turn --gateway "$gateway" --num-conversations 16 --turns 4 \
    --system-prompt-len 256 --num-system-prompts 4 --user-len 32-96 --output-len 32-64 \
    --max-concurrency 4 --seed 0 --disable-tqdm --json "docs/bench/multi_turn_${policy}.json"
  stop_stack
done
