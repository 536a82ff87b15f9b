"""What a request at the documented bounds costs the requests beside it: `pdserve bench bounds`.

    pdserve bench bounds --json docs/bench/bounds.json

The gateway runs as its own process pinned to one core; a synthetic decode instance
(bench.fakes.fake_decode, no model) that streams one token every --pace-ms (10 ms, a
CPU-like decode; 2 ms, a fast GPU's; 0, as fast as the gateway takes them, which
saturates its core) and the clients run in this process on the other core. So what is measured is the work the
bounds let a request put on the gateway (chat-template rendering and tokenization of
1024 messages, 64 stop strings of 512 characters searched in every piece of text,
256 stop token ids), not a model's: a long prompt's prefill costs the engine what any
prompt of that length costs, and the engine's chunked prefill is what bounds that.

A normal request (a short prompt, --tokens output tokens) is timed end to end, one at a
time, --requests times, while one neighbour request runs beside it all along (a new one
starts as soon as the last ends): no neighbour, a normal neighbour, and a neighbour at
each bound (and at all of them at once). Each neighbour streams as many tokens as the
normal request, so the only difference between "normal neighbour" and the others is
the bound. Reported: the normal request's median end-to-end time per neighbour, and
its slowdown against the normal neighbour (the cost of the bound itself; the target is
at most 20%) and against no neighbour.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import grpc

from bench.fakes.fake_decode import FakeDecode
from bench.profile import machine_info, now_iso
from common.cli.processes import start_gateway_process
from common.engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from common.service.common_api import sampling_params_to_pb
from gateway.validation import MAX_CHAT_MESSAGES, load_served_model
from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc

TOKEN_IDS = list(range(1000, 1064))  # ordinary word pieces of the bundled tokenizer
PROMPT = "Write a short story about a lighthouse keeper."
# Never in the fake's text, so every stop string is searched for in every piece of it.
LONG_STOP = "\u00a7" * MAX_STOP_STRING_CHARS
TARGET_SLOWDOWN = 0.20


def _request(kind: str, num_tokens: int, request_id: str) -> generate_pb2.GenerateRequest:
    """A request of the normal shape, with the lists of `kind` at their bounds."""
    stop = [LONG_STOP] * MAX_STOP_STRINGS if kind in ("stop strings", "all bounds") else []
    stop_token_ids = (list(range(1, MAX_STOP_TOKEN_IDS + 1))
                      if kind in ("stop token ids", "all bounds") else [])
    sampling = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, stop=stop,
                              stop_token_ids=stop_token_ids)
    request = generate_pb2.GenerateRequest(sampling=sampling_params_to_pb(sampling), request_id=request_id)
    if kind in ("chat messages", "all bounds"):
        # Empty turns: the most messages for the fewest tokens (~5 each), still a valid prompt.
        request.messages.messages.extend(generate_pb2.ChatMessage(role="user" if i % 2 == 0 else "assistant",
                                                                  content="")
                                         for i in range(MAX_CHAT_MESSAGES - 1))
        request.messages.messages.append(generate_pb2.ChatMessage(role="user", content=PROMPT))
    else:
        request.text = PROMPT
    return request


NEIGHBOURS = ("none", "normal", "stop strings", "stop token ids", "chat messages", "all bounds")


async def _timed(stub, request) -> float:
    started = time.perf_counter()
    async for _ in stub.GenerateStream(request, timeout=120):
        pass
    return time.perf_counter() - started


async def measure(stub, neighbour: str, num_requests: int, num_tokens: int) -> list[float]:
    """The normal request's end-to-end seconds, each with `neighbour` running beside it."""
    stop = asyncio.Event()

    async def neighbours() -> int:
        count = 0
        while not stop.is_set():
            await _timed(stub, _request(neighbour, num_tokens, f"neighbour-{neighbour}-{count}"))
            count += 1
        return count

    task = asyncio.create_task(neighbours()) if neighbour != "none" else None
    try:
        if task is not None:
            await asyncio.sleep(0.2)  # the neighbour is streaming
        return [await _timed(stub, _request("normal", num_tokens, f"timed-{neighbour}-{i}"))
                for i in range(num_requests)]
    finally:
        stop.set()
        if task is not None:
            await task


async def measure_pace(stub, fake: FakeDecode, pace_ms: float, args: argparse.Namespace) -> dict:
    fake.servicer.delay_s = pace_ms / 1e3
    rows, medians = [], {}
    for neighbour in NEIGHBOURS:
        seconds = await measure(stub, neighbour, args.requests, args.tokens)
        medians[neighbour] = statistics.median(seconds)
        rows.append({"neighbour": neighbour, "median_e2e_ms": round(medians[neighbour] * 1e3, 1),
                     "max_e2e_ms": round(max(seconds) * 1e3, 1)})
    for row in rows:
        median = medians[row["neighbour"]]
        row["slowdown_vs_normal_neighbour"] = round(median / medians["normal"] - 1, 3)
        row["slowdown_vs_alone"] = round(median / medians["none"] - 1, 3)
    worst = max(row["slowdown_vs_normal_neighbour"] for row in rows if row["neighbour"] not in ("none", "normal"))
    return {"pace_ms": pace_ms, "rows": rows, "worst_slowdown_vs_normal_neighbour": worst,
            "target_met": worst <= TARGET_SLOWDOWN}


async def run(args: argparse.Namespace) -> dict:
    machine = machine_info(2).model_dump()  # before this process pins itself to one core
    cpus = sorted(os.sched_getaffinity(0))
    gateway_cpu, own_cpus = ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (set(cpus), set(cpus))
    gateway = start_gateway_process(["--port", "0", "--log-level", "WARNING"], cpus=gateway_cpu, echo=False)
    os.sched_setaffinity(0, own_cpus)
    try:
        fake = FakeDecode("decode-fake", gateway.registry_address, token_ids=TOKEN_IDS,
                          model_name=load_served_model(None).name)
        await fake.start()
        try:
            async with grpc.aio.insecure_channel(gateway.address) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                for kind in NEIGHBOURS:  # warm-up: every path once (the chat template compiles)
                    await _timed(stub, _request(kind if kind != "none" else "normal", 4, f"warm-{kind}"))
                paces = [await measure_pace(stub, fake, pace_ms, args) for pace_ms in args.pace_ms]
        finally:
            await fake.stop()
    finally:
        gateway.stop()
    return {"benchmark": "bounds", "when": now_iso(), "machine": machine,
            "config": {"requests": args.requests, "tokens": args.tokens, "gateway_cpus": sorted(gateway_cpu),
                       "target_slowdown": TARGET_SLOWDOWN}, "paces": paces}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench bounds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10, help="timed normal requests per neighbour")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens of every request")
    parser.add_argument("--pace-ms", type=lambda s: [float(p) for p in s.split(",")], default=[10.0, 2.0, 0.0],
                        help="the fake decode's time per token, comma-separated: a CPU-like decode, a fast "
                             "GPU's, and none (the gateway's core saturated)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    print("| ms per token | neighbour | median e2e ms | max e2e ms | vs normal neighbour | vs alone |")
    print("|---|---|---|---|---|---|")
    for pace in results["paces"]:
        for row in pace["rows"]:
            print(f"| {pace['pace_ms']:g} | {row['neighbour']} | {row['median_e2e_ms']} | {row['max_e2e_ms']} | "
                  f"{row['slowdown_vs_normal_neighbour']:+.1%} | {row['slowdown_vs_alone']:+.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
