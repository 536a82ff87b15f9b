"""gpu_check.sh's section of docs/benchmarks.md, built from a results directory laid out as the
script leaves it (JSON files recorded by earlier GPU and CPU runs), so the summary is checked
on machines that never run the script for real."""
from __future__ import annotations

import datetime
import shutil
from pathlib import Path

from bench import gpu_check_summary

REPO = Path(__file__).resolve().parents[3]
RECORDED = REPO / "docs" / "bench"


def results_dir(tmp_path: Path) -> Path:
    results = tmp_path / "gpu-check"
    results.mkdir()
    (results / "device.txt").write_text("NVIDIA H200 | torch 2.11.0+cu130 | triton 3.6.0\n")
    (results / "kernels.log").write_text("....\n43 passed in 61.2s\nrc=0 after 64 s\n")
    (results / "graphs.log").write_text("FAILED tests/x.py::test_y\n1 failed, 9 passed in 12.0s\nrc=1 after 14 s\n")
    shutil.copy(RECORDED / "gpu_h200_offline_compiled.json", results / "offline-compiled.json")
    shutil.copy(RECORDED / "gpu_h200_offline_eager.json", results / "offline-eager.json")
    (results / "offline-kv-fp8.log").write_text("Traceback ...\nValueError: fp8 KV needs compute capability 8.9\n"
                                                "rc=1 after 20 s\n")
    shutil.copy(RECORDED / "spec_zen5_1202_loop.json", results / "spec.json")
    return results


def test_the_section_reports_each_step_it_ran(tmp_path):
    results = results_dir(tmp_path)
    text = gpu_check_summary.section(results, ["kernels", "graphs", "offline", "spec"], datetime.date(2026, 12, 2))
    lines = text.splitlines()
    assert lines[1] == "## GPU check (2026-12-02, NVIDIA H200 | torch 2.11.0+cu130 | triton 3.6.0)"
    assert "- Triton kernel tests on the GPU: 43 passed in 61.2s (rc=0 after 64 s)" in lines
    assert "- CUDA-graph tests: 1 failed, 9 passed in 12.0s (rc=1 after 14 s)" in lines
    assert not any("parity" in line for line in lines)  # not among the steps run
    compiled = next(line for line in lines if line.startswith("- offline, compiled + CUDA graphs (bf16)"))
    assert "x HF's" in compiled and "decode steps replayed from graphs: 255" in compiled
    assert "- offline, compiled, no CUDA graphs: failed (not run)" in lines
    assert ("- offline, compiled + CUDA graphs, fp8 KV cache: failed "
            "(ValueError: fp8 KV needs compute capability 8.9 (rc=1 after 20 s))") in lines
    assert any(line.startswith("- measured rooflines: copy ") for line in lines)
    spec = [line for line in lines if line.startswith("- bench spec, ")]
    assert len(spec) == 6  # three workloads, one stream and batched
    assert spec[0] == ("- bench spec, copy, single stream (bf16, k = 4): off 174 tok/s (1.00x); ngram 560 tok/s "
                       "(3.22x, acceptance 0.97); early_exit 152 tok/s (0.87x, acceptance 0.03)")


def test_offline_arms_run_as_steps_of_their_own_report_only_those_arms(tmp_path):
    results = results_dir(tmp_path)
    text = gpu_check_summary.section(results, ["offline-compiled", "offline-kv-fp8"])
    offline = [line for line in text.splitlines() if line.startswith("- offline, ")]
    assert [line.split(" (bf16)")[0].split(":")[0] for line in offline] == [
        "- offline, compiled + CUDA graphs", "- offline, compiled + CUDA graphs, fp8 KV cache"]
    assert "failed (ValueError" in offline[1]
    assert "- measured rooflines: copy " in text


def test_a_missing_spec_result_is_reported_as_failed(tmp_path):
    results = results_dir(tmp_path)
    (results / "spec.json").unlink()
    (results / "spec.log").write_text("Killed\nrc=124 after 240 s\n")
    text = gpu_check_summary.section(results, ["spec"])
    assert "- bench spec (bf16): failed (Killed (rc=124 after 240 s))" in text.splitlines()


def test_main_appends_the_section_and_keeps_a_copy(tmp_path):
    results = results_dir(tmp_path)
    benchmarks = tmp_path / "benchmarks.md"
    benchmarks.write_text("# Benchmarks\n")
    assert gpu_check_summary.main([str(results), "kernels", "--benchmarks-md", str(benchmarks)]) == 0
    written = benchmarks.read_text()
    assert written.startswith("# Benchmarks\n\n## GPU check (")
    assert written.endswith((results / "benchmarks_section.md").read_text())
