#!/usr/bin/env bash
# Multi-turn chat on a colocated stack: two decode instances that prefill every prompt
# themselves (`pdserve up --prefill 0 --decode 2`), one stack per arm, the same seeded
# conversations through `pdserve bench multi-turn` (16 conversations x 4 turns, 4 system
# prompts of 256 tokens, 32-96 user and 32-64 answer tokens a turn, $OPEN open at once,
# $THINK seconds between an answer and the next turn). An arm is POLICY or
# prefix_aware:KV_LOAD_WEIGHT (the gateway's --kv-load-weight).
#   [OPEN=4] [THINK=0] bash scripts/bench_multi_turn.sh [ARM ...]
#   # default arms: least_loaded prefix_aware:1.0 prefix_aware
# Writes docs/bench/multi_turn_<policy>[_kv<weight>][_think<THINK>].json and prints each report.
set -euo pipefail
cd "$(dirname "$0")/.."
open=${OPEN:-4}
think=${THINK:-0}
suffix=""
[ "$think" = 0 ] || suffix="_think${think}"
policies=("$@")
[ $# -gt 0 ] || policies=(least_loaded prefix_aware:1.0 prefix_aware)
mkdir -p docs/bench
. scripts/local_stack.sh
trap stop_stack EXIT
for arm in "${policies[@]}"; do
  policy=${arm%%:*}
  weight_flags=()
  name=$policy
  if [ "$arm" != "$policy" ]; then
    weight_flags=(--kv-load-weight "${arm#*:}")
    name="${policy}_kv${arm#*:}"
  fi
  start_stack --prefill 0 --decode 2 --policy "$policy" "${weight_flags[@]}" --log-level WARNING
  echo "== --policy $policy ${weight_flags[*]} (gateway $gateway)"
  .venv/bin/pdserve bench multi-turn --gateway "$gateway" --num-conversations 16 --turns 4 \
    --system-prompt-len 256 --num-system-prompts 4 --user-len 32-96 --output-len 32-64 \
    --max-concurrency "$open" --think-time "$think" --seed 0 --disable-tqdm \
    --json "docs/bench/multi_turn_${name}${suffix}.json"
  stop_stack
done
