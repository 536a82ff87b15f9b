"""scripts/as_avx2.sh: a command run as an AVX2-only CPU would run it, on either side of a
peer comparison."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "as_avx2.sh"

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="an x86-64 CPU with AVX2 runs the stand-in")

PROBE = """
import json, os, torch
from kernels.cpu.build import target_arch
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(), "march": target_arch(),
                  "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA"), "avx512": torch.cpu._is_avx512_supported()}))
"""


def _probe(python_path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=python_path)
    proc = subprocess.run(["bash", str(SCRIPT), sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pdserve_side_builds_for_x86_64_v3_and_every_library_stops_at_avx2():
    seen = _probe(str(REPO))
    assert seen["aten"] == "AVX2"
    assert seen["march"] == "x86-64-v3"
    assert seen["onednn"] == "AVX2"
    # pdserve's own processes keep torch's answers: nothing of vLLM is installed here.
    assert seen["avx512"] == torch.cpu._is_avx512_supported()


def test_where_vllm_is_installed_torch_answers_no_avx512(tmp_path):
    # vLLM's CPU platform loads _C_AVX2 on that answer (vllm/platforms/cpu.py, import_kernels);
    # an importable package named vllm is what the stand-in looks for.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    seen = _probe(f"{tmp_path}{os.pathsep}{REPO}")
    assert seen["avx512"] is False
    assert seen["aten"] == "AVX2"
