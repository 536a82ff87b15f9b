"""Offered load past capacity on a real stack: `pdserve bench overload`.

    pdserve bench overload --json docs/bench/overload.json

One LocalStack (1 prefill + 1 decode, the bundled model). Capacity is measured first: a
closed loop of --max-running requests at a time, completed requests per second. Then
Poisson arrivals at each multiple of it (--load-factors, default 0.5, 1, 2, 3) for
--duration seconds each. Every request either completes, or is refused by the gateway's
admission (RESOURCE_EXHAUSTED, at once: its wait queue holds --max-waiting requests), or
fails otherwise; a failure for queueing (DEADLINE_EXCEEDED) is what must not happen.
Per load: sent, completed, refused and failed counts by status, the p50/p99 end-to-end
latency of completed requests, the p99 time to a refusal, and whether every KV block of
every instance was free afterwards.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench.chaos import pools_free
from bench.profile import machine_info, now_iso, versions
from bench.serve.arrivals import send_offsets
from bench.serve.datasets import ranged_requests

PROMPT_LEN, OUTPUT_LEN = 256, 64


def _status(error: str) -> str:
    return error.split(":", 1)[0] if error else "OK"


async def _send_all(backend, requests, rate: float, seed: int) -> list[dict]:
    from bench.serve.client import send_one
    offsets = send_offsets(len(requests), rate, 1.0, seed)
    start = time.perf_counter()

    async def paced(request, offset: float) -> dict:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        sent = time.perf_counter()
        outcome = await send_one(backend, request, start)
        return {"status": _status(outcome.error),
                "seconds": time.perf_counter() - sent, "error": outcome.error}
    return await asyncio.gather(*(paced(r, o) for r, o in zip(requests, offsets)))


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def run(args) -> dict:
    from bench.routing import model_vocabulary, wait_idle
    from bench.serve.client import GrpcGenerateBackend
    from common.cli.up import LocalStack
    vocab = model_vocabulary(None)
    rng = np.random.default_rng(args.seed)

    def requests(num: int):
        return ranged_requests(num, vocab, rng, (PROMPT_LEN, PROMPT_LEN), (OUTPUT_LEN, OUTPUT_LEN))

    engine = ["--kv-cache-memory", "512MiB", "--max-num-seqs", str(args.max_running)]
    gateway = ["--max-running-per-decode", str(args.max_running), "--max-waiting-requests", str(args.max_waiting)]
    result = {"benchmark": "overload", "when": now_iso(), "machine": machine_info(2).model_dump(),
              "versions": versions().model_dump(),
              "config": {"prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "max_running": args.max_running,
                         "max_waiting": args.max_waiting, "duration_s": args.duration,
                         "stack": "1 prefill + 1 decode, bundled model", "engine_flags": engine,
                         "gateway_flags": gateway}, "loads": []}
    with LocalStack(1, 1, passthrough=engine, role_flags={"gateway": gateway}, log_dir=args.log_dir) as stack:
        async def drive() -> None:
            async with GrpcGenerateBackend(stack.address, request_id_prefix="overload") as backend:
                await _send_all(backend, requests(2), float("inf"), args.seed)  # warm-up
                started = time.perf_counter()
                closed = await _send_all(backend, requests(args.max_running * 2), float("inf"), args.seed)
                capacity = sum(r["status"] == "OK" for r in closed) / (time.perf_counter() - started)
                result["capacity_req_s"] = round(capacity, 3)
                print(f"capacity {capacity:.2f} req/s", flush=True)
                for index, factor in enumerate(args.load_factors):
                    await asyncio.to_thread(wait_idle, stack)
                    rate = factor * capacity
                    num = max(4, round(rate * args.duration))
                    outcomes = await _send_all(backend, requests(num), rate, args.seed + index + 1)
                    await asyncio.to_thread(wait_idle, stack)
                    result["loads"].append(_summarize(factor, rate, outcomes, await asyncio.to_thread(
                        pools_free, stack)))
                    print(format_row(result["loads"][-1]), flush=True)
        asyncio.run(drive())
    return result


def _summarize(factor: float, rate: float, outcomes: list[dict], blocks_free: bool) -> dict:
    statuses = Counter(o["status"] for o in outcomes)
    done = [o["seconds"] for o in outcomes if o["status"] == "OK"]
    refused = [o["seconds"] for o in outcomes if o["status"] == "RESOURCE_EXHAUSTED"]
    return {"load_factor": factor, "offered_req_s": round(rate, 3), "sent": len(outcomes),
            "completed": statuses.pop("OK", 0), "refused": statuses.pop("RESOURCE_EXHAUSTED", 0),
            "failed": dict(statuses), "p50_e2e_ms": _percentile(done, 50), "p99_e2e_ms": _percentile(done, 99),
            "p99_refusal_ms": _percentile(refused, 99), "pools_free_after": blocks_free,
            "errors": sorted({o["error"] for o in outcomes if o["error"] and o["status"] != "RESOURCE_EXHAUSTED"})[:5]}


def format_row(load: dict) -> str:
    return (f"| {load['load_factor']:g}x | {load['offered_req_s']:.2f} | {load['sent']} | {load['completed']} | "
            f"{load['refused']} | {sum(load['failed'].values())} {dict(load['failed']) or ''} | "
            f"{load['p50_e2e_ms']} | {load['p99_e2e_ms']} | {load['p99_refusal_ms']} | {load['pools_free_after']} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench overload", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load-factors", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1, 2, 3])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per load")
    parser.add_argument("--max-running", type=int, default=8, help="engine --max-num-seqs and the gateway's cap")
    parser.add_argument("--max-waiting", type=int, default=8, help="the gateway's --max-waiting-requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    result = run(args)
    print("| load | offered req/s | sent | completed | refused (429) | failed | p50 e2e ms | p99 e2e ms | "
          "p99 refusal ms | pools free after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for load in result["loads"]:
        print(format_row(load))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
