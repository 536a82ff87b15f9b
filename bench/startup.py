"""Start-up to the first token, cold and with the caches: `pdserve bench startup`.

Two arms, each started as fresh processes: the offline command (`pdserve generate-offline
"Hello" --max-tokens 4`, one process, timed whole) and a local stack (gateway, one
prefill and one decode process, as `pdserve up` runs them, one torch thread each on two
cores) timed from launch to its first answer (not to the end of its shutdown). Each runs first with an empty compile
cache (TORCHINDUCTOR_CACHE_DIR, where the compiled model is saved), then again with the
cache that run filled, `--repeats` times. The native kernels' cache (PDSERVE_KERNEL_CACHE)
is the machine's unless --cold-kernels, which gives every cold run an empty one too.

    pdserve bench startup --out docs/bench/startup.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.profile import machine_info, now_iso, versions

REPO_ROOT = Path(__file__).resolve().parents[1]

_STACK_SCRIPT = """
import sys, time
from common.cli.up import LocalStack
from gateway.client import Client
started = time.perf_counter()
with LocalStack(1, 1, passthrough=["--kv-cache-memory", "256MiB"]) as stack:
    Client(stack.address).generate("Hello", max_tokens=4, temperature=0)
    print(time.perf_counter() - started)
"""


def timed_run(argv: list[str], env: dict[str, str], timeout_s: float, reports_own_time: bool = False) -> float:
    """Seconds from launching argv to its exit (it must succeed); reports_own_time: the
    seconds it printed as its last line instead (the stack, timed to its first answer,
    not to the end of its shutdown)."""
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    if reports_own_time:
        return float(done.stdout.strip().splitlines()[-1])
    return time.perf_counter() - started


def run_arm(name: str, argv: list[str], reports_own_time: bool, repeats: int, cold_kernels: bool,
            timeout_s: float) -> dict:
    cold, cached = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as compile_cache, tempfile.TemporaryDirectory() as kernel_cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=compile_cache)
            if cold_kernels:
                env["PDSERVE_KERNEL_CACHE"] = kernel_cache
            cold.append(round(timed_run(argv, env, timeout_s, reports_own_time), 1))
            cached.append(round(timed_run(argv, env, timeout_s, reports_own_time), 1))
        print(f"{name}: cold {cold[-1]} s, with the caches {cached[-1]} s", file=sys.stderr, flush=True)
    return {"cold_s": cold, "cached_s": cached}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    parser.add_argument("--repeats", type=int, default=1, help="cold + cached pairs per arm")
    parser.add_argument("--arms", default="offline,stack", help="offline, stack or both (comma-separated)")
    parser.add_argument("--cold-kernels", action="store_true",
                        help="cold runs also build the native CPU kernels (an empty PDSERVE_KERNEL_CACHE)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one start may take")
    args = parser.parse_args(argv)
    # Per arm: its command, and whether it prints its own time (see timed_run).
    commands = {
        "offline": ([sys.executable, "-m", "common.cli.main", "generate-offline", "Hello", "--max-tokens", "4"],
                    False),
        "stack": ([sys.executable, "-c", _STACK_SCRIPT], True),
    }
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = sorted(set(arms) - set(commands))
    if unknown:
        parser.error(f"unknown arm(s) {unknown}: offline, stack")
    result = {"when": now_iso(), "machine": machine_info(num_threads=os.cpu_count() or 1).model_dump(),
              "versions": versions().model_dump(), "cold_kernels": args.cold_kernels,
              "arms": {arm: run_arm(arm, *commands[arm], args.repeats, args.cold_kernels, args.timeout)
                       for arm in arms}}
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
