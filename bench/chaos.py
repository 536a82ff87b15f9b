"""Fault injection on a real stack, NVIDIA Dynamo's tests/fault_tolerance as a command:
`pdserve bench chaos`.

    pdserve bench chaos --json docs/bench/chaos.json

One LocalStack (1 prefill + 1 decode to start, the bundled model). Each scenario runs
--requests requests (256 prompt / 64 output tokens) through the gateway, injects its
fault at a phase of those requests, and records: the status every client got, how long
after the fault the last request ended, whether the gateway's readiness told the truth
(where the fault changes it), and whether every KV block of every live instance was
free afterwards. Scenarios, in order (each leaves the stack with 1 prefill + 1 decode):

- kill-prefill-while-prefilling: SIGKILL the prefill instance while it runs prompts; the
  decode instance recomputes them locally (a new prefill instance joins after).
- kill-decode-while-streaming: SIGKILL the only decode instance after first tokens;
  streams end UNAVAILABLE, readiness goes NOT_SERVING, and SERVING once a new one joins.
- kill-decode-of-two-while-streaming: SIGKILL one of two decode instances after first
  tokens; the gateway migrates its streams to the other, which continues them
  (longest_stall_s: the longest wait between two tokens any client saw; migrations: the
  gateway's pdserve_request_migrations_total over the scenario).
- stop-decode-while-streaming: SIGSTOP a decode instance (2 running) after first tokens;
  the channel's keepalive finds it silent, the gateway drops it and migrates its calls
  (or ends them, at --migration-limit 0; failed_ended_after_s: when the last of the
  frozen one's failed requests ended).
- drain-decode: SIGTERM a decode instance (2 running) with requests in flight; they finish.
- restart-prefill: SIGTERM the prefill instance, start a new one; requests then succeed.
- scale-decode: 1 -> 3 -> 1 decode instances, three times, with traffic in between; the
  gateway's resident memory before and after.
- abort-storm: --requests x 4 requests cancelled right after they start; then a normal
  round succeeds.
The 3x overload case is `pdserve bench overload`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

from bench.profile import machine_info, now_iso, versions
from bench.serve.datasets import ranged_requests

PROMPT_LEN, OUTPUT_LEN = 256, 64
READINESS_SERVICE = "pdserve.v1.GenerateService"


class Round:
    """Requests in flight through the gateway: per request its first-token event and its status."""

    def __init__(self, backend, requests):
        self.first_token = [asyncio.Event() for _ in requests]
        self.statuses: list[str | None] = [None] * len(requests)
        self.ended_at: list[float] = [0.0] * len(requests)
        # The longest wait between two of a request's tokens (a stall a fault caused shows here).
        self.longest_gap_s: list[float] = [0.0] * len(requests)
        self.tasks = [asyncio.ensure_future(self._run(backend, r, i)) for i, r in enumerate(requests)]

    async def _run(self, backend, request, index: int) -> None:
        last_token_at = None
        try:
            async for _, num_tokens in backend.stream(request):
                if num_tokens:
                    now = time.monotonic()
                    if last_token_at is not None:
                        self.longest_gap_s[index] = max(self.longest_gap_s[index], now - last_token_at)
                    last_token_at = now
                    self.first_token[index].set()
            self.statuses[index] = "OK"
        except grpc.aio.AioRpcError as e:
            self.statuses[index] = e.code().name
        except asyncio.CancelledError:
            self.statuses[index] = "CANCELLED_BY_CLIENT"
        except Exception as e:  # a client-side failure is a result too
            self.statuses[index] = type(e).__name__
        self.ended_at[index] = time.monotonic()

    async def first_tokens(self, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(e.is_set() for e in self.first_token) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {sum(e.is_set() for e in self.first_token)} of {count} first tokens")
            await asyncio.sleep(0.01)

    async def finish(self, timeout_s: float = 180.0) -> Counter:
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout_s)
        return Counter(self.statuses)


def _stats(address: str, role: str):
    from bench.routing import instance_stats
    return instance_stats(address, role)


def _wait_until(condition, timeout_s: float, what: str) -> float:
    """Seconds until condition() held; TimeoutError naming `what` past timeout_s."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.02)
    return time.monotonic() - started


def _ready(stack) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(stack.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=READINESS_SERVICE), timeout=5).status
    return status == health_pb2.HealthCheckResponse.SERVING


def _live(stack) -> dict:
    return {name: p for name, p in stack.instances.items() if p.process.poll() is None}


def pools_free(stack, timeout_s: float = 60.0) -> bool:
    """Every KV block of every live instance free, and nothing running, within timeout_s."""
    def free() -> bool:
        for name, process in _live(stack).items():
            load = _stats(process.address, name.split("-")[0]).load
            if load.num_free_blocks != load.num_total_blocks or load.num_running_requests:
                return False
        return True
    try:
        _wait_until(free, timeout_s, "every block free")
        return True
    except TimeoutError:
        return False


def _gateway_migrations(stack) -> float:
    """The gateway's pdserve_request_migrations_total, scraped."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://{stack.gateway.metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "pdserve_request_migrations_total")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def scenario(name: str, stack, backend, make_requests, args) -> dict:
    loop_thread = asyncio.to_thread
    row: dict = {"scenario": name}
    fault_at = time.monotonic()
    r: Round | None = None  # the round the fault hit
    if name == "kill-prefill-while-prefilling":
        prefill = next(n for n in _live(stack) if n.startswith("prefill"))
        decode = next(n for n in _live(stack) if n.startswith("decode"))
        r = Round(backend, make_requests(args.requests))
        # The decode instance holds the prompts' reservations while their Prefill calls run.
        await loop_thread(_wait_until, lambda: _stats(stack.instances[decode].address, "decode").load
                          .num_running_requests > 0, 60, "the decode instance waiting for remote KV")
        fault_at = time.monotonic()
        stack.kill(prefill)
        row["statuses"] = await r.finish()
        await loop_thread(stack.add_instance, "prefill")
    elif name == "kill-decode-while-streaming":
        decode = next(n for n in _live(stack) if n.startswith("decode"))
        r = Round(backend, make_requests(args.requests))
        await r.first_tokens(1)
        fault_at = time.monotonic()
        stack.kill(decode)
        row["statuses"] = await r.finish()
        await loop_thread(_wait_until, lambda: not _ready(stack), 30, "readiness NOT_SERVING")
        row["readiness_false_after_s"] = round(time.monotonic() - fault_at, 2)
        await loop_thread(stack.add_instance, "decode")
        row["readiness_true_after_join_s"] = round(await loop_thread(_wait_until, lambda: _ready(stack), 30,
                                                                     "readiness SERVING"), 2)
    elif name in ("kill-decode-of-two-while-streaming", "stop-decode-while-streaming", "drain-decode"):
        # Two decode instances, every request streaming; then the first one is killed (its
        # streams migrate), frozen (SIGSTOP: the gateway must drop it) or drained (SIGTERM:
        # its calls finish).
        await loop_thread(stack.add_instance, "decode")
        await loop_thread(stack.wait_registered, 1, 2)
        migrations_before = _gateway_migrations(stack)
        r = Round(backend, make_requests(args.requests))
        await r.first_tokens(args.requests)
        decode = sorted(n for n in _live(stack) if n.startswith("decode"))[0]
        fault_at = time.monotonic()
        frozen = name == "stop-decode-while-streaming"
        stack.kill(decode, {"kill-decode-of-two-while-streaming": signal.SIGKILL,
                            "stop-decode-while-streaming": signal.SIGSTOP}.get(name, signal.SIGTERM))
        row["statuses"] = await r.finish()
        row["longest_stall_s"] = round(max(r.longest_gap_s), 2)
        row["migrations"] = int(_gateway_migrations(stack) - migrations_before)
        if frozen:
            failed_ended_at = [t for t, status in zip(r.ended_at, r.statuses) if status != "OK"]
            if failed_ended_at:  # the frozen instance's requests, not migrated (--migration-limit 0)
                row["failed_ended_after_s"] = round(max(failed_ended_at) - fault_at, 2)
            stack.kill(decode, signal.SIGCONT)
            stack.kill(decode, signal.SIGTERM)
        await loop_thread(stack.instances[decode].wait_or_kill, 60)
    elif name == "restart-prefill":
        prefill = next(n for n in _live(stack) if n.startswith("prefill"))
        stack.kill(prefill, signal.SIGTERM)
        await loop_thread(stack.instances[prefill].wait_or_kill, 60)
        await loop_thread(stack.add_instance, "prefill")
        await loop_thread(stack.wait_registered, 1, 1)
        row["statuses"] = await Round(backend, make_requests(args.requests)).finish()
    elif name == "scale-decode":
        rss_before = _rss_mib(stack.gateway.process.pid)
        statuses = Counter()
        for _ in range(3):
            for _ in range(2):
                await loop_thread(stack.add_instance, "decode")
            await loop_thread(stack.wait_registered, 1, 3)
            statuses += await Round(backend, make_requests(args.requests)).finish()
            for decode in sorted(n for n in _live(stack) if n.startswith("decode"))[:2]:
                stack.kill(decode, signal.SIGTERM)
                await loop_thread(stack.instances[decode].wait_or_kill, 60)
            statuses += await Round(backend, make_requests(args.requests)).finish()
        row["statuses"] = statuses
        row["gateway_rss_mib"] = [round(rss_before, 1), round(_rss_mib(stack.gateway.process.pid), 1)]
    elif name == "abort-storm":
        r = Round(backend, make_requests(args.requests * 4))
        await asyncio.sleep(0.5)
        fault_at = time.monotonic()
        for task in r.tasks:
            task.cancel()
        await asyncio.gather(*r.tasks, return_exceptions=True)
        for i, status in enumerate(r.statuses):  # a task cancelled before it ran never recorded itself
            if status is None:
                r.statuses[i], r.ended_at[i] = "CANCELLED_BY_CLIENT", time.monotonic()
        storm = Counter(r.statuses)
        row["statuses"] = storm + await Round(backend, make_requests(args.requests)).finish()
    else:
        raise ValueError(f"unknown scenario {name!r}")
    if r is not None:
        row["last_end_after_fault_s"] = round(max(r.ended_at) - fault_at, 2)
    row["statuses"] = dict(row["statuses"])
    row["pools_free_after"] = await loop_thread(pools_free, stack)
    return row


SCENARIOS = ("kill-prefill-while-prefilling", "kill-decode-while-streaming", "kill-decode-of-two-while-streaming",
             "stop-decode-while-streaming", "drain-decode", "restart-prefill", "scale-decode", "abort-storm")


def run(args) -> dict:
    from bench.routing import model_vocabulary
    from bench.serve.client import GrpcGenerateBackend
    from common.cli.up import LocalStack
    vocab = model_vocabulary(None)
    rng = np.random.default_rng(args.seed)

    def make_requests(num: int):
        return ranged_requests(num, vocab, rng, (PROMPT_LEN, PROMPT_LEN), (OUTPUT_LEN, OUTPUT_LEN))

    result = {"benchmark": "chaos", "when": now_iso(), "machine": machine_info(2).model_dump(),
              "versions": versions().model_dump(), "config": {
                  "requests_per_scenario": args.requests, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                  "heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 5.0}, "scenarios": []}
    engine = ["--kv-cache-memory", "256MiB"]
    with LocalStack(1, 1, passthrough=engine, log_dir=args.log_dir) as stack:
        async def drive() -> None:
            async with GrpcGenerateBackend(stack.address, request_id_prefix="chaos") as backend:
                await Round(backend, make_requests(2)).finish()  # warm-up
                for name in args.scenarios:
                    row = await scenario(name, stack, backend, make_requests, args)
                    result["scenarios"].append(row)
                    print(format_row(row), flush=True)
        asyncio.run(drive())
    return result


def format_row(row: dict) -> str:
    extra = {k: v for k, v in row.items() if k not in ("scenario", "statuses", "last_end_after_fault_s",
                                                      "pools_free_after")}
    return (f"| {row['scenario']} | {', '.join(f'{k} {v}' for k, v in sorted(row['statuses'].items()))} | "
            f"{row.get('last_end_after_fault_s', '-')} | {row['pools_free_after']} | "
            f"{', '.join(f'{k} {v}' for k, v in extra.items()) or '-'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", type=lambda s: s.split(","), default=list(SCENARIOS),
                        help=f"comma-separated, in order; default all: {','.join(SCENARIOS)}")
    parser.add_argument("--requests", type=int, default=4, help="requests per scenario")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    for name in args.scenarios:
        if name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    result = run(args)
    print("| scenario | client statuses | last request ended after the fault, s | every block free after | other |")
    print("|---|---|---|---|---|")
    for row in result["scenarios"]:
        print(format_row(row))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
