#!/usr/bin/env bash
# The test command: set up (idempotent), check the import layers, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Layers and the torch-free gateway, as [tool.importlinter] in pyproject.toml declares them.
.venv/bin/lint-imports --no-cache
exec .venv/bin/python -m pytest -q "$@"
