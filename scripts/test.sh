#!/usr/bin/env bash
# The test command: set up (idempotent), check the import layers, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Layers and the torch-free gateway, as [tool.importlinter] in pyproject.toml declares them.
.venv/bin/lint-imports --no-cache

# For the whole suite, the compose test's prerequisites (Docker engine, base image,
# wheelhouse, image build: minutes of downloads and disk writes where nothing is cached)
# are made in the background while the other tests run; that test runs last and waits.
state=$(mktemp -d)
prepare_pid=""
cleanup() {
  if [ -n "$prepare_pid" ]; then kill "$prepare_pid" 2>/dev/null || true; wait "$prepare_pid" 2>/dev/null || true; fi
  if [ -s "$state/dockerd.pid" ]; then  # a Docker engine the preparation started
    pid=$(cat "$state/dockerd.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  fi
  [ -s "$state/prepare.log" ] && sed 's/^/[background] /' "$state/prepare.log"
  rm -rf "$state"
}
trap cleanup EXIT
if [ "$#" = 0 ] && [ "${PDSERVE_DEPLOY_TEST:-1}" != 0 ]; then
  nice -n 10 .venv/bin/python -m tests.support.deploy_image --dockerd-pid-file "$state/dockerd.pid" \
    >"$state/prepare.log" 2>&1 &
  prepare_pid=$!
fi
.venv/bin/python -m pytest -q "$@"
