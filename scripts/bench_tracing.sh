#!/usr/bin/env bash
# What tracing costs a served stack: the same seeded workload through `pdserve bench serve`
# on a local stack (`pdserve up --prefill 1 --decode 1`: three hops, three spans a request)
# without and with --otlp-traces-endpoint (a real OTLP/gRPC receiver on loopback,
# tests/support/otlp_collector.py), in turn, ROUNDS times.
#   bash scripts/bench_tracing.sh [RATE] [ROUNDS]      # default: 4 req/s, 2 rounds
# Writes docs/bench/tracing_{off,on}_<round>.json and prints each report's headline figures.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-4}
rounds=${2:-2}
mkdir -p docs/bench
collector_log=$(mktemp)
.venv/bin/python - >"$collector_log" 2>&1 <<'PY' &
import signal, time
from tests.support.otlp_collector import OtlpCollector
with OtlpCollector() as collector:
    print(f"endpoint {collector.endpoint}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (print(f"received {len(collector.spans())} spans", flush=True),
                                              exit(0)))
    while True:
        time.sleep(1)
PY
collector=$!
. scripts/local_stack.sh
trap 'stop_stack; kill $collector 2>/dev/null || true' EXIT
until grep -q '^endpoint' "$collector_log"; do sleep 0.2; done
endpoint=$(sed -n 's/^endpoint //p' "$collector_log")
for round in $(seq 1 "$rounds"); do
  for mode in off on; do
    extra=()
    [ "$mode" = on ] && extra=(--otlp-traces-endpoint "$endpoint")
    start_stack --prefill 1 --decode 1 --log-level WARNING "${extra[@]}"
    echo "== round $round, tracing $mode"
    .venv/bin/pdserve bench serve --gateway "$gateway" --dataset-name random --random-input-len 256 \
      --random-output-len 64 --num-prompts 120 --request-rate "$rate" --seed "$round" --disable-tqdm \
      --json "docs/bench/tracing_${mode}_${round}.json" | grep -E "Output token throughput|Mean TTFT|P99 TTFT|Mean TPOT|P99 TPOT"
    stop_stack
  done
done
kill -TERM $collector
wait $collector || true
grep '^received' "$collector_log"
rm -f "$collector_log"
