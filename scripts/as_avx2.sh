#!/usr/bin/env bash
# Run a command as an AVX2-only CPU (a Zen 3) would, on an AVX-512 machine: a stand-in for
# measuring the AVX2 paths of both pdserve and vLLM's CPU build where no such CPU is at hand.
#   bash scripts/as_avx2.sh .venv/bin/pdserve bench offline --dtype float32 --peer vllm --skip-hf --peer-threads-bind all
# pdserve's native kernels build for x86-64-v3; oneDNN (both sides' linears), ATen and
# inductor's generated code stop at AVX2; vLLM loads its _C_AVX2 kernels
# (avx2_stand_in/sitecustomize.py). The FMA width and count per cycle are then the Zen 3's;
# clock, caches and memory bandwidth stay this machine's, so compare ratios, not rates.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PDSERVE_CPU_MARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
export PYTHONPATH="$here/avx2_stand_in${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
