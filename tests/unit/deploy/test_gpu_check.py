"""scripts/gpu_check.sh keeps working on a machine without a GPU: it says so and exits 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("script", ["gpu_check.sh", "prepare_gpu_wheels.sh", "setup_vllm_peer.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run for real")
def test_gpu_check_without_a_gpu_says_so_and_changes_nothing(tmp_path):
    before = (REPO / "docs" / "benchmarks.md").read_text()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path)], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path)},
                          timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr
    assert (REPO / "docs" / "benchmarks.md").read_text() == before
