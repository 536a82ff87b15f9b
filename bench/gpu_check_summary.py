"""The figures of one `scripts/gpu_check.sh` run as a section of docs/benchmarks.md: each
test step's pytest summary, each offline arm's throughput, and `bench spec`'s speedups,
read from the step logs and JSON files the script leaves in its results directory.

    python -m bench.gpu_check_summary RESULTS "STEP ..." [--benchmarks-md PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

TEST_STEPS = (("kernels", "Triton kernel tests on the GPU"),
              ("cpu-kernels", "native CPU kernel tests, built with this machine's g++"),
              ("graphs", "CUDA-graph tests"),
              ("parity", "greedy parity with Hugging Face (fp32, eager)"))
OFFLINE_ARMS = (("compiled", "compiled + CUDA graphs"), ("no-graphs", "compiled, no CUDA graphs"),
                ("eager", "eager"), ("kv-fp8", "compiled + CUDA graphs, fp8 KV cache"))


def outcome(results: Path, name: str) -> str:
    """A step's pytest summary line (or its last words) and its exit status line."""
    path = results / f"{name}.log"
    if not path.exists():
        return "not run"
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return "no output"
    summary = next((line for line in reversed(lines) if " passed" in line or " failed" in line
                    or " error" in line), lines[-2] if len(lines) > 1 else "no output")
    return f"{summary.strip('= ')} ({lines[-1]})"


def offline_line(what: str, r: dict) -> str:
    mixed, single = r["mixed"], r["single_stream"]
    hf = mixed.get("speedup_vs_hf")
    line = (f"- offline, {what} (bf16): mixed {mixed['ours_output_tokens_per_s']:.0f} output tok/s"
            + (f" ({hf:.2f}x HF's {mixed['hf_output_tokens_per_s']:.0f})" if hf else "")
            + f"; single stream {single['ours_tokens_per_s']:.1f} tok/s"
            + (f" ({single['speedup_vs_hf']:.2f}x HF's {single['hf_tokens_per_s']:.1f})"
               if "speedup_vs_hf" in single else "")
            + f", {single['ours_pct_of_roofline']:.1f}% of the weight-read roofline;"
            + f" start-up {r['startup']['seconds']:.1f} s; recompiles after warm-up {r['recompiles_after_warm_up']}")
    if "cuda_graphs" in r:
        line += f"; decode steps replayed from graphs: {r['cuda_graphs']['decode_steps_replayed']}"
    return line


def spec_lines(r: dict) -> list[str]:
    lines = []
    for workload, modes in r["workloads"].items():
        for mode, arms in modes.items():
            parts = [f"{arm} {a['output_tokens_per_s']:.0f} tok/s ({a['speedup']:.2f}x"
                     + (f", acceptance {a['acceptance_rate']:.2f}" if a["acceptance_rate"] is not None else "")
                     + ("" if a["same_tokens_as_off"] else ", tokens differ from off") + ")"
                     for arm, a in arms.items()]
            lines.append(f"- bench spec, {workload}, {mode.replace('_', ' ')} (bf16, k = "
                         f"{r['num_speculative_tokens']}): " + "; ".join(parts))
    return lines


def section(results: Path, steps: list[str], today: datetime.date | None = None) -> str:
    device = (results / "device.txt").read_text().strip()
    lines = [f"\n## GPU check ({today or datetime.date.today()}, {device})\n",
             f"Command: `scripts/gpu_check.sh WHEEL_DIR {' '.join(steps)}` on the GPU machine.\n"]
    lines += [f"- {what}: {outcome(results, name)}" for name, what in TEST_STEPS if name in steps]
    arms_run = [(arm, what) for arm, what in OFFLINE_ARMS if "offline" in steps or f"offline-{arm}" in steps]
    if arms_run:
        reports = {arm: json.loads(path.read_text()) for arm, _ in arms_run
                   if (path := results / f"offline-{arm}.json").exists()}
        for arm, what in arms_run:
            lines.append(offline_line(what, reports[arm]) if arm in reports
                         else f"- offline, {what}: failed ({outcome(results, 'offline-' + arm)})")
        roof = next((reports[a]["roofline"] for a in ("compiled", "no-graphs", "eager") if a in reports), None)
        if roof:
            lines.append(f"- measured rooflines: copy {roof['copy_bandwidth_GBps']:.0f} GB/s (read + write), "
                         f"{roof.get('matmul_dtype', 'fp32')} matmul {roof.get('matmul_GFLOPs', 0) / 1e3:.0f} TFLOP/s")
    if "spec" in steps:
        path = results / "spec.json"
        lines += (spec_lines(json.loads(path.read_text())) if path.exists()
                  else [f"- bench spec (bf16): failed ({outcome(results, 'spec')})"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check_summary", description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="gpu_check.sh's results directory")
    parser.add_argument("steps", help="the steps it ran, space-separated")
    parser.add_argument("--benchmarks-md", type=Path, default=Path("docs/benchmarks.md"),
                        help="the file the section is appended to")
    args = parser.parse_args(argv)
    text = section(args.results, args.steps.split())
    with args.benchmarks_md.open("a") as f:
        f.write(text)
    (args.results / "benchmarks_section.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
