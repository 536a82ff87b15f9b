"""Child processes running `pdserve <command>`, for the launcher, tests and benchmarks.

A child is `python -m common.cli.main <command> ...` (what the `pdserve` script runs). Its
stdout is read by a thread that echoes each line with a `[name]` prefix and picks
up the `PDSERVE_READY ... grpc=HOST:PORT` line every service prints once serving (its
key=value fields, e.g. `metrics=HOST:PORT`, land in `ready_fields`).
Children get SIGTERM if this process dies (PR_SET_PDEATHSIG), so a crashed test or
launcher leaves no model-sized orphans behind.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_READY_FIELD = re.compile(r"\b([a-z_]+)=(\S+)")


class ProcessFailed(RuntimeError):
    """A child exited although nobody asked it to."""


# The commands `pdserve up` runs, by the module that owns their flags.
COMMAND_MODULES = {"gateway": "gateway.main", "prefill": "prefill_service.main", "decode": "decode_service.main"}
PER_PROCESS_FLAGS = ("--host", "--port", "--instance-id", "--gateway", "--advertise-address", "--metrics-port",
                     "--registry-port")


def route_flags(flags: list[str]) -> dict[str, list[str]]:
    """Give each command the flags (and values) it defines, as its own parser reads them:
    ["--kv-cache-memory", "256MiB", "--policy", "round_robin"] ->
    {"gateway": ["--policy", "round_robin"], "prefill": ["--kv-cache-memory", "256MiB"], "decode": [...]}.
    A flag no command defines is an error rather than silently ignored."""
    import importlib
    parsers = {command: importlib.import_module(module).build_parser()
               for command, module in COMMAND_MODULES.items()}
    routed: dict[str, list[str]] = {command: [] for command in parsers}
    i = 0
    while i < len(flags):
        flag, has_inline_value, _ = flags[i].partition("=")
        if flag in PER_PROCESS_FLAGS:
            raise ValueError(f"{flag} differs per process; pdserve up sets it")
        owners = [c for c, parser in parsers.items() if flag in parser._option_string_actions]
        if not owners:
            raise ValueError(f"unknown flag {flags[i]!r}: none of pdserve gateway, prefill, decode takes it")
        nargs = parsers[owners[0]]._option_string_actions[flag].nargs
        count = 2 if nargs != 0 and not has_inline_value else 1
        if nargs in ("+", "*") and not has_inline_value:  # its values run to the next flag
            count = next((j for j in range(i + 1, len(flags)) if flags[j].startswith("-")), len(flags)) - i
        if i + count > len(flags) or (nargs == "+" and count == 1 and not has_inline_value):
            raise ValueError(f"{flag} needs a value")
        for command in owners:
            routed[command] += flags[i:i + count]
        i += count
    return routed


def _child_setup(cpus: set[int] | None):
    def setup() -> None:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass  # not Linux: children outlive a crashed parent; stop() still cleans up
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


class ManagedProcess:
    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                 log_dir: str | os.PathLike | None = None, cpus: set[int] | None = None, echo: bool = True):
        self.name = name
        self.address = ""  # from the PDSERVE_READY line
        self.ready_fields: dict[str, str] = {}  # every key=value of that line
        self.ready = threading.Event()
        self.stopping = False  # signalled on purpose: exiting is not a failure
        self.last_lines: deque[str] = deque(maxlen=20)
        self.log_path = Path(log_dir) / f"{name}.log" if log_dir else None
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        stderr = open(self.log_path, "ab") if self.log_path else None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "common.cli.main", *argv], stdout=subprocess.PIPE, stderr=stderr,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}, preexec_fn=_child_setup(cpus),
            text=True, bufsize=1)
        if stderr is not None:
            stderr.close()  # the child has its own copy
        self._echo = echo
        threading.Thread(target=self._read_stdout, name=f"stdout-{name}", daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.last_lines.append(line)
            if line.startswith("PDSERVE_READY"):
                self.ready_fields = dict(_READY_FIELD.findall(line))
                self.address = self.ready_fields.get("grpc", "")
                self.ready.set()
            if self._echo:
                print(f"[{self.name}] {line}", flush=True)

    @property
    def metrics_address(self) -> str:
        """host:port of its Prometheus endpoint ("" when it serves none)."""
        return self.ready_fields.get("metrics", "")

    @property
    def registry_address(self) -> str:
        """host:port of the gateway's instance registry ("" for other processes)."""
        return self.ready_fields.get("registry", "")

    @property
    def http_address(self) -> str:
        """host:port of the gateway's OpenAI-compatible HTTP API ("" when it serves none)."""
        return self.ready_fields.get("http", "")

    def wait_ready(self, timeout_s: float) -> str:
        """Wait for the PDSERVE_READY line; return the gRPC address it names."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.1):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not report ready within {timeout_s:.0f}s")
        return self.address

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None and not self.stopping:
            tail = ""
            if self.log_path and self.log_path.exists():
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-10:])
            raise ProcessFailed(f"{self.name} exited with code {code}" + (f":\n{tail}" if tail else ""))

    def signal(self, signum: int) -> None:
        self.stopping = True
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def wait_or_kill(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def stop(self, grace_s: float = 10.0) -> int:
        self.signal(signal.SIGTERM)
        return self.wait_or_kill(grace_s)


def start_gateway_process(argv: list[str], timeout_s: float = 60.0, **kwargs) -> ManagedProcess:
    """`pdserve gateway ARGV`, returned once serving (its address in .address)."""
    process = ManagedProcess("gateway", ["gateway", *argv], **kwargs)
    try:
        process.wait_ready(timeout_s)
    except BaseException:
        process.stop()
        raise
    return process
