"""`pdserve up`, `pdserve generate` and `pdserve health` as a user runs them: real
processes, the bundled model, one decode instance (prefill done locally)."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

PDSERVE = [sys.executable, "-m", "common.cli.main"]


def pdserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=timeout)


def test_up_serves_generate_and_health_then_stops_cleanly_on_sigterm(tmp_path):
    stderr_path = tmp_path / "up.stderr"
    up = subprocess.Popen([*PDSERVE, "up", "--prefill", "0", "--decode", "1", "--port", "0",
                           "--kv-cache-memory", "64MiB", "--log-level", "WARNING"],
                          stdout=subprocess.PIPE, stderr=stderr_path.open("w"), text=True)
    try:
        address = None
        deadline = time.monotonic() + 240
        for line in up.stdout:  # children's lines come prefixed with [name]
            match = re.match(r"PDSERVE_READY gateway=(\S+) prefill=0 decode=1$", line.strip())
            if match:
                address = match.group(1)
                break
            assert time.monotonic() < deadline
        assert address, f"no READY line; stderr: {stderr_path.read_text()}"

        health = pdserve("health", address)
        assert (health.returncode, health.stdout.strip()) == (0, "SERVING")
        result = pdserve("generate", "--gateway", address, "--raw", "--max-tokens", "8", "--usage",
                         "The capital of France is")
        assert result.returncode == 0, result.stderr
        assert "Paris" in result.stdout and "decode=decode-0" in result.stderr
        bad = pdserve("generate", "--gateway", address, "--raw", "--max-tokens", "100000", "hi")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        assert pdserve("health", address, "--timeout", "2").returncode == 2  # nothing listens any more
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_up_reports_a_child_that_dies_and_exits_non_zero():
    # A KV pool too small for one block: the decode process exits with an error at start.
    result = pdserve("up", "--prefill", "0", "--decode", "1", "--port", "0", "--kv-cache-memory", "1KiB",
                     timeout=240)
    assert result.returncode == 1
    assert "decode-0 exited with code" in result.stderr


def test_up_rejects_a_flag_no_command_takes():
    result = pdserve("up", "--decode", "1", "--kv-cache-memroy", "64MiB", timeout=60)
    assert result.returncode == 2 and "--kv-cache-memroy" in result.stderr


def test_health_of_nothing_is_unreachable_and_generate_without_gateway_fails():
    assert pdserve("health", "127.0.0.1:1", "--timeout", "1").returncode == 2
    result = pdserve("generate", "--gateway", "127.0.0.1:1", "--timeout", "2", "hi")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr
