# Sourced by the serving benchmark scripts (bench_long_prefill.sh, bench_tracing.sh): one local
# stack at a time, from the repository root.
#   start_stack ARGS...   # `pdserve up ARGS` in the background; sets $gateway once it serves
#   stop_stack            # SIGTERM (the stack drains), then wait; safe to call twice
stack_pid=""
stack_log=""

start_stack() {
  stack_log=$(mktemp)
  .venv/bin/pdserve up "$@" >"$stack_log" 2>&1 &
  stack_pid=$!
  local deadline=$((SECONDS + 300))
  until grep -q '^PDSERVE_READY' "$stack_log"; do
    if [ $SECONDS -gt $deadline ] || ! kill -0 "$stack_pid" 2>/dev/null; then
      cat "$stack_log"
      stop_stack
      return 1
    fi
    sleep 0.5
  done
  gateway=$(sed -n 's/^PDSERVE_READY gateway=\([^ ]*\).*/\1/p' "$stack_log")
}

stop_stack() {
  if [ -n "$stack_pid" ]; then
    kill -TERM "$stack_pid" 2>/dev/null || true
    wait "$stack_pid" || true
  fi
  rm -f "$stack_log"
  stack_pid=""
  stack_log=""
}
