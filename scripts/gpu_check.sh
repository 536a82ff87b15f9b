#!/usr/bin/env bash
# On a CUDA machine that has torch and triton but no package registry:
#   install   pdserve's other dependencies from a directory of wheels made elsewhere
#             (scripts/prepare_gpu_wheels.sh) into a directory of their own, beside the
#             machine's torch (always done; skipped when that directory already holds them),
#   kernels   the Triton kernel tests on the GPU (compiled for the device, not interpreted),
#   cpu-kernels  every native CPU library's tests (attention, GEMVs and panel GEMMs, the decode
#             loop, argmax, huge-page arena), built with that machine's g++ for its CPU (their
#             refusals of bad arguments once crashed a g++ 13 build; see docs/benchmarks.md),
#   graphs    the CUDA-graph tests (decode steps replayed from captured graphs),
#   parity    greedy parity with Hugging Face on the GPU (fp32, bundled model, eager),
#   offline   the offline benchmark in bf16: compiled with CUDA graphs (beside Hugging Face on
#             the same GPU), compiled without graphs, eager, and with an fp8 KV cache
#             (each arm is also a step of its own: offline-compiled, offline-no-graphs,
#             offline-eager, offline-kv-fp8),
#   spec      `bench spec` in bf16 (n-gram and early-exit drafts against none, one stream and
#             batched: verification steps replay the decode graphs where their rows fit a bucket),
# then writes the figures into docs/benchmarks.md (and, with $OUT set, copies under $OUT).
#   scripts/gpu_check.sh [WHEEL_DIR [STEP...]]   (WHEEL_DIR default: wheels/, or $PDSERVE_WHEELS;
#                                                STEP default: kernels cpu-kernels graphs parity offline spec)
# Each step runs under its own time limit, so one that hangs leaves the others their time.
# PDSERVE_GPU_BUDGET_S=N (a lent machine's time left): a step whose limit would end past N
# seconds from the start is skipped, and says so, rather than cut off mid-run.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-${PDSERVE_WHEELS:-wheels}}
shift || true
STEPS=${*:-kernels cpu-kernels graphs parity offline spec}
RESULTS=${PDSERVE_GPU_RESULTS:-gpu-check}
SITE=${PDSERVE_SITE:-$RESULTS/site}
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch; nothing to check" >&2
    exit 2
fi
[ -d "$WHEELS" ] || { echo "gpu_check: no wheel directory $WHEELS (make it with scripts/prepare_gpu_wheels.sh)" >&2; exit 2; }
mkdir -p "$RESULTS" "$SITE"
RESULTS=$(cd "$RESULTS" && pwd)
SITE=$(cd "$SITE" && pwd)
# --no-deps and a target directory: pip leaves the machine's torch alone (pyproject pins the
# CPU build's version) and resolves nothing it would have to download.
if ! ls "$WHEELS" | cmp -s - "$SITE/.wheels"; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl \
        || { echo "gpu_check: installing the wheels failed" >&2; exit 2; }
    ls "$WHEELS" > "$SITE/.wheels"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m protos.build >/dev/null || { echo "gpu_check: generating the protobuf modules failed" >&2; exit 2; }
"$PY" -c "import torch, triton; print(torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', triton.__version__)" \
    | tee "$RESULTS/device.txt"
BUDGET=${PDSERVE_GPU_BUDGET_S:-}
status=0
step() {  # step NAME SECONDS COMMAND...: its output in $RESULTS/NAME.log, its last line shown
    local name=$1 limit=$2
    shift 2
    if [ -n "$BUDGET" ] && [ $((SECONDS + limit)) -gt "$BUDGET" ]; then
        echo "skipped: its ${limit} s limit would end past the ${BUDGET} s budget (at ${SECONDS} s)" \
            | tee "$RESULTS/$name.log"
        status=1
        return
    fi
    echo "== $name (limit ${limit}s)"
    local started=$SECONDS
    timeout -k 10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    echo "rc=$rc after $((SECONDS - started)) s" >> "$RESULTS/$name.log"
    tail -n 2 "$RESULTS/$name.log"
    [ "$rc" = 0 ] || status=1
}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
BENCH=("$PY" -m common.cli.main bench offline --dtype bfloat16)
offline_arm() {  # offline_arm ARM: one arm of the offline benchmark, in a fresh process
    local json="$RESULTS/offline-$1.json"
    case $1 in
        compiled) step offline-compiled 200 "${BENCH[@]}" --peer hf --json "$json" ;;
        no-graphs) step offline-no-graphs 90 env PDSERVE_CUDA_GRAPHS=0 "${BENCH[@]}" --peer none --json "$json" ;;
        eager) step offline-eager 90 "${BENCH[@]}" --peer none --enforce-eager --json "$json" ;;
        kv-fp8) step offline-kv-fp8 120 "${BENCH[@]}" --peer none --kv-cache-dtype fp8 --json "$json" ;;
        *) echo "gpu_check: unknown offline arm $1" >&2; status=1 ;;
    esac
}
for s in $STEPS; do
    case $s in
        kernels) step kernels 240 "${PYTEST[@]}" tests/unit/kernels/test_kernels.py \
                     tests/unit/kernels/test_attention_features.py ;;
        # 420 s: building every library and its AVX2 / baseline variants took the 8 cores it
        # was given beside the GPU steps past 300 s once (123 s with the libraries built).
        cpu-kernels) step cpu-kernels 420 "${PYTEST[@]}" tests/unit/kernels/test_cpu_builds.py \
                         tests/unit/kernels/test_cpu_paged_attention.py tests/unit/kernels/test_cpu_linear.py \
                         tests/unit/kernels/test_cpu_sampling.py tests/unit/kernels/test_huge_pages.py \
                         tests/unit/kernels/test_cpu_attention_head_dims.py ;;
        graphs) step graphs 150 "${PYTEST[@]}" tests/unit/common/engine/test_cuda_graphs.py ;;
        parity) step parity 150 env PDSERVE_DTYPE=float32 PDSERVE_ENFORCE_EAGER=1 "${PYTEST[@]}" \
                    tests/integration/test_parity_bundled.py ;;
        offline) offline_arm compiled; offline_arm no-graphs; offline_arm eager; offline_arm kv-fp8 ;;
        offline-*) offline_arm "${s#offline-}" ;;
        spec) step spec 240 "$PY" -m common.cli.main bench spec --dtype bfloat16 --json "$RESULTS/spec.json" ;;
        *) echo "gpu_check: unknown step $s" >&2; status=1 ;;
    esac
done
"$PY" -m bench.gpu_check_summary "$RESULTS" "$STEPS" || status=1
if [ -n "${OUT:-}" ]; then  # what comes back from a lent machine: the section and every log
    cp "$RESULTS/benchmarks_section.md" "$OUT/" 2>/dev/null
    tar -czf "$OUT/gpu_check_results.tgz" -C "$RESULTS" --exclude=site . 2>/dev/null
fi
exit $status
