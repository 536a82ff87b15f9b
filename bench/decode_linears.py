"""`pdserve bench decode-linears`: one decode step's linears, each kernel that can run them.

SmolLM2-135M's projections (30 layers of distinct weights: qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536) and its LM head (49152x576), for a few rows of x (1 to 4
by default): what a decode step of that many tokens multiplies. Dense weights in fp32 and
bf16 through oneDNN's packed linear (what prefill steps use), a plain `F.linear`, the
native GEMV (kernels/cpu/gemv.cpp, up to 4 rows) reading row-major copies on huge pages
as the model's do (fp32; bf16 without AVX512-BF16) and, for bf16 with AVX512-BF16,
`panel_gemm` (kernels/cpu/panel_gemm.h, on AMX tiles where the CPU has them; what a bf16
model's steps of 1 to panel_gemm_max_rows() rows take there) on column-panel copies, also on
huge pages; the bundled GGUF's own Q4_1 projections through torch's int4 kernel and the
native Q4_1 GEMV; the LM head alone (fp32), dense through oneDNN and the GEMV, and as the
GGUF's own Q8_0 blocks through the native Q8_0 GEMV (what `--quantization gguf` decodes
with). The kernels of a case run alternately, repetitions interleaved, and each reports
the median and min milliseconds per pass over all layers (the head included for dense
weights) and the weight bytes read per second at the min.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from kernels.cpu.build import cpu_flags
from kernels.cpu_linear import (GEMV_MAX_ROWS, gemv, native_gemv_available, pack_panels, panel_gemm, panels_apply,
                                q4_1_gemv, q4_1_gemv_blocks, q8_0_gemv)
from kernels.huge_pages import on_huge_pages

HIDDEN, INTERMEDIATE, QKV, VOCAB, NUM_LAYERS = 576, 1536, 960, 49152, 30
LAYER_SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
PROJECTIONS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def time_kernels(kernels: dict[str, Callable[[], object]], reps: int) -> dict[str, dict[str, float]]:
    """Median and min ms per call of each kernel, the kernels' reps interleaved."""
    samples: dict[str, list[float]] = {name: [] for name in kernels}
    for run in kernels.values():  # warm-up: builds, first-touch pages
        run()
    for _ in range(reps):
        for name, run in kernels.items():
            started = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - started) * 1e3)
    return {name: {"median_ms": statistics.median(s), "min_ms": min(s)} for name, s in samples.items()}


def dense_case(dtype: torch.dtype, num_rows: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen).to(dtype) for _ in range(NUM_LAYERS) for shape in LAYER_SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype))
    xs = {k: torch.randn(num_rows, k, generator=gen).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
    kernels: dict[str, Callable[[], object]] = {
        "F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights]}
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        kernels["onednn_packed"] = lambda: [
            torch.ops.mkldnn._linear_pointwise.default(xs[w.shape[1]], p, None, "none", [-1], "")
            for w, p in zip(weights, packed)]
    except RuntimeError:
        pass  # oneDNN cannot pack this dtype here
    takes_gemv = native_gemv_available() and num_rows <= GEMV_MAX_ROWS
    if takes_gemv:  # the GEMV's row-major copies on huge pages, as PrepackedLinear keeps them
        row_major = [on_huge_pages(w) for w in weights]
        kernels["native_gemv"] = lambda: [gemv(xs[w.shape[1]], None, w) for w in row_major]
    if all(panels_apply(w) for w in weights):
        panels = [pack_panels(w, huge_pages=True) for w in weights]
        kernels["panel_gemm"] = lambda: [panel_gemm(xs[w.shape[1]], None, p) for w, p in zip(weights, panels)]
    num_bytes = sum(w.numel() * w.element_size() for w in weights)
    return {"weights": str(dtype).removeprefix("torch."), "num_rows": num_rows, "weight_bytes": num_bytes,
            "kernels": with_bandwidth(time_kernels(kernels, reps), num_bytes)}


def q4_1_case(num_rows: int, reps: int) -> dict:
    from common.engine.model_files import bundled_gguf_path
    from common.engine.models.quantization.gguf_blocks import GGUFQuantizedWeights
    from common.engine.models.quantization.q4_1_linear import Q4_1Linear

    source = GGUFQuantizedWeights(bundled_gguf_path())
    blocks = [source.projection(layer, name) for layer in range(NUM_LAYERS) for name in PROJECTIONS]
    linears = [Q4_1Linear(b, None, torch.device("cpu")) for b in blocks]
    raws = [q4_1_gemv_blocks(b.raw()) for b in blocks]  # as Q4_1Linear keeps them
    gen = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(num_rows, k, generator=gen).to(torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}
    kernels: dict[str, Callable[[], object]] = {}
    if all(linear.uses_kernel for linear in linears):
        kernels["torch_int4"] = lambda: [
            torch.ops.aten._weight_int4pack_mm_for_cpu(xs[lin.in_features], lin.packed, lin.group_size,
                                                       lin.scales_and_zeros) for lin in linears]
    if native_gemv_available() and num_rows <= GEMV_MAX_ROWS:
        kernels["native_q4_1_gemv"] = lambda: [q4_1_gemv(xs[lin.in_features], None, raw)
                                               for lin, raw in zip(linears, raws)]
    num_bytes = sum(raw.numel() for raw in raws)
    return {"weights": "q4_1", "num_rows": num_rows, "weight_bytes": num_bytes,
            "kernels": with_bandwidth(time_kernels(kernels, reps), num_bytes)}


def head_case(num_rows: int, reps: int) -> dict:
    from common.engine.model_files import bundled_gguf_path
    from common.engine.models.quantization.gguf_blocks import GGUFQuantizedWeights

    blocks = GGUFQuantizedWeights(bundled_gguf_path()).head_q8_0()
    raw, dense = blocks.raw(), blocks.dequantize(torch.float32)
    x = torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.mkldnn._reorder_linear_weight(dense, None)
    kernels: dict[str, Callable[[], object]] = {
        "onednn_packed_fp32": lambda: torch.ops.mkldnn._linear_pointwise.default(x, packed, None, "none", [-1], "")}
    if native_gemv_available() and num_rows <= GEMV_MAX_ROWS:
        kernels["native_gemv_fp32"] = lambda: gemv(x, None, dense)
        kernels["native_q8_0_gemv"] = lambda: q8_0_gemv(x, None, raw)
    timings = time_kernels(kernels, reps)
    for name, timing in timings.items():
        timing["gb_per_s"] = (raw.numel() if "q8_0" in name else dense.numel() * 4) / timing["min_ms"] / 1e6
    return {"weights": "head (fp32 / q8_0)", "num_rows": num_rows, "weight_bytes": raw.numel(), "kernels": timings}


def with_bandwidth(timings: dict[str, dict[str, float]], num_bytes: int) -> dict[str, dict[str, float]]:
    for timing in timings.values():
        timing["gb_per_s"] = num_bytes / timing["min_ms"] / 1e6
    return timings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench decode-linears", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4", help="rows of x (decode tokens per step), comma-separated")
    parser.add_argument("--weights", default="fp32,bf16,q4_1,head", help="fp32, bf16, q4_1 and/or head")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = set(cpu_flags().split())
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
                          "avx512_bf16": "avx512_bf16" in flags, "avx2": "avx2" in flags,
                          "native_gemv": native_gemv_available()},
              "cases": []}
    for weights in args.weights.split(","):
        for num_rows in (int(r) for r in args.rows.split(",")):
            if weights == "q4_1":
                case = q4_1_case(num_rows, args.reps)
            elif weights == "head":
                case = head_case(num_rows, args.reps)
            else:
                case = dense_case({"fp32": torch.float32, "bf16": torch.bfloat16}[weights], num_rows, args.reps)
            result["cases"].append(case)
            print(f"{weights:5s} rows={num_rows} ({case['weight_bytes'] / 1e6:.0f} MB): " + ", ".join(
                f"{name} {t['median_ms']:.2f} ms (min {t['min_ms']:.2f}, {t['gb_per_s']:.1f} GB/s)"
                for name, t in case["kernels"].items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
