#!/usr/bin/env bash
# The test command: set up (idempotent), check the import layers, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Where PYTHONDONTWRITEBYTECODE is set (this machine sets it), every process of the suite
# (each pytest worker, each service it starts, each fresh-process test: hundreds) would
# compile pdserve's modules and rewrite the tests' asserts again (~0.6 s an engine
# import, ~5 s a worker's collection). Here Python keeps them in __pycache__ (git- and
# docker-ignored), and setup.sh leaves the installed packages to be compiled as imported.
unset PYTHONDONTWRITEBYTECODE

# For the whole suite, the compose test's prerequisites (Debian's docker.io and debootstrap
# where .ci/run asks for them, Docker engine, base image, wheelhouse, image build: minutes
# of downloads and disk writes where nothing is cached) are made in the background while
# setup and the parallel part run; that test waits for them.
state=$(mktemp -d)
prepare_pid=""
deploy_pid=""
cleanup() {
  # An interrupted run: SIGINT lets the compose test take its stack down first.
  if [ -n "$deploy_pid" ]; then kill -INT "$deploy_pid" 2>/dev/null || true; wait "$deploy_pid" 2>/dev/null || true; fi
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
  (
    # apt-get beside pip: each keeps one of the cores busy.
    if [ "${PDSERVE_DEPLOY_INSTALL_PACKAGES:-0}" = 1 ]; then
      { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap; } \
        >"$state/apt.log" 2>&1 || { echo "installing docker.io and debootstrap failed:"; tail -n 5 "$state/apt.log"; }
    fi
    # The preparation runs in the venv that setup.sh is making meanwhile.
    while [ ! -e "$state/setup.done" ]; do sleep 1; done
    exec nice -n 10 .venv/bin/python -m tests.support.deploy_image --dockerd-pid-file "$state/dockerd.pid"
  ) >"$state/prepare.log" 2>&1 &
  prepare_pid=$!
fi
bash scripts/setup.sh
touch "$state/setup.done"
# Layers and the torch-free gateway, as [tool.importlinter] in pyproject.toml declares them.
.venv/bin/lint-imports --no-cache
if [ "$#" != 0 ]; then  # a selection of tests: as given, one pytest
  .venv/bin/python -m pytest -q "$@"
  exit 0
fi
# The whole suite in four parts (tests/conftest.py --suite-part), on two pytest-xdist
# workers where the tests allow it: the unit tests that assert no wall-clock bound and the
# integration tests marked `in_process` (the offline engine only; most are one Python
# thread each, so two cores run two of them; tests/conftest.py keeps a module's tests that
# share its fixtures on one worker); beside them, in a pytest of its own, the compose test,
# which waits on containers with generous deadlines and alone kept only one core busy (its
# output follows the services part's); then the integration tests that start services as
# processes, a module per worker (--dist loadfile: its services start once), since they
# spend a third of their time starting processes and waiting on them, which the other
# worker fills; last, once the compose test is done, one at a time, the tests marked
# `timing` (a wall-clock bound a shared core could break). Every part always runs; the
# suite fails if any does.
# (--suite-part=NAME: pytest reads a lone NAME as a path before it knows the option, and the
# repository has a deploy/ folder.)
status=0
# (An asynchronous command of a script ignores SIGINT; reset, an interrupt reaches it and the
# compose test takes its stack down. One torch thread: the other part's workers have the cores.)
( trap - INT; OMP_NUM_THREADS=1 exec .venv/bin/python -m pytest -q -p no:cacheprovider --suite-part=deploy ) \
  >"$state/deploy.log" 2>&1 &
deploy_pid=$!
.venv/bin/python -m pytest -q -n 2 --dist loadgroup --suite-part=parallel || status=$?
.venv/bin/python -m pytest -q -n 2 --dist loadfile --suite-part=services || status=$?
deploy_status=0
wait "$deploy_pid" || deploy_status=$?
deploy_pid=""
cat "$state/deploy.log"
[ "$deploy_status" = 0 ] || status=$deploy_status
.venv/bin/python -m pytest -q --suite-part=serial || status=$?
exit "$status"
