"""`--quantization` reaches the engine through the real CLI: `pdserve generate-offline` in a
subprocess serves the GGUF's Q4_1 blocks (its load log line says so) and refuses gguf for a
Hugging Face directory with a clear error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATE_OFFLINE = [sys.executable, "-m", "common.cli.main", "generate-offline", "--raw", "--max-tokens", "8",
                    "--temperature", "0", "--kv-cache-memory", "32MiB", "--log-level", "INFO"]
TIMEOUT_S = 300


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # cwd: `python -m` puts the repository first on sys.path
    return subprocess.run([*GENERATE_OFFLINE, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_generate_offline_serves_gguf_blocks():
    result = run_cli("The capital of France is", "--quantization", "gguf")
    assert result.returncode == 0, result.stderr
    assert "quantization gguf: 120 projections as Q4_1" in result.stderr
    assert result.stdout.strip()


def test_generate_offline_refuses_gguf_for_a_hf_directory(bundled_model_dir):
    result = run_cli("Hi", "--quantization", "gguf", "--model", str(bundled_model_dir))
    assert result.returncode == 2
    assert "pdserve: error: quantization gguf serves the quantized blocks of a GGUF file" in result.stderr
