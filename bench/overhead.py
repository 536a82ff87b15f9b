"""What the gateway itself costs per streamed token: `pdserve bench overhead`.

The gateway runs as its own process pinned to one core; a synthetic decode instance
(bench.fakes.fake_decode, no model) and the clients run in this process on another core,
so the numbers are the gateway's, not a model's.

- latency: paced streams (one token every --pace-ms); per token, the time from the
  fake decode handing it to gRPC to the client receiving it, through the gateway
  and directly from the fake decode. Added latency = median(via gateway) - median(direct).
- throughput: --streams concurrent streams of --tokens tokens, sent as fast as the
  gateway takes them; tokens/s over wall time, and tokens per CPU-second of the
  gateway process (its own capacity on one core, however busy the machine is).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import grpc

from bench.fakes.fake_decode import FakeDecode
from common.cli.processes import start_gateway_process
from common.engine.sampling_params import SamplingParams
from common.service.common_api import sampling_params_to_pb
from gateway.validation import load_served_model
from protos.pdserve.v1 import decode_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc

TOKEN_IDS = list(range(1000, 1064))  # ordinary word pieces of the bundled tokenizer


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _latencies(stream_call, fake: FakeDecode, request_id: str) -> list[float]:
    received = []
    async for _ in stream_call:
        received.append(time.perf_counter())
    sent = fake.servicer.send_times.pop(request_id)
    return [r - s for r, s in zip(received, sent)]


async def measure_latency(gateway_address: str, fake: FakeDecode, num_requests: int, num_tokens: int,
                          pace_s: float) -> dict:
    fake.servicer.delay_s = pace_s
    sampling = SamplingParams(max_tokens=num_tokens, temperature=0)
    via_gateway, direct = [], []
    async with grpc.aio.insecure_channel(gateway_address) as gw, \
            grpc.aio.insecure_channel(fake.address) as dec:
        gateway_stub = generate_pb2_grpc.GenerateServiceStub(gw)
        decode_stub = decode_pb2_grpc.DecodeServiceStub(dec)
        for i in range(num_requests):
            request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]),
                                                   sampling=sampling_params_to_pb(sampling),
                                                   request_id=f"lat-gw-{i}")
            via_gateway += await _latencies(gateway_stub.GenerateStream(request), fake, f"lat-gw-{i}")
            request = decode_pb2.DecodeRequest(request_id=f"lat-direct-{i}", prompt_token_ids=[1, 2, 3],
                                               sampling=sampling_params_to_pb(sampling))
            direct += await _latencies(decode_stub.Decode(request), fake, f"lat-direct-{i}")
    gw_ms, direct_ms = statistics.median(via_gateway) * 1e3, statistics.median(direct) * 1e3
    return {"tokens": len(via_gateway), "median_ms_via_gateway": round(gw_ms, 3),
            "median_ms_direct": round(direct_ms, 3), "median_added_ms": round(gw_ms - direct_ms, 3),
            "p90_ms_via_gateway": round(statistics.quantiles(via_gateway, n=10)[-1] * 1e3, 3)}


async def measure_throughput(gateway_address: str, fake: FakeDecode, gateway_pid: int, num_streams: int,
                             num_tokens: int) -> dict:
    fake.servicer.delay_s = 0.0
    fake.servicer.send_times = None
    sampling = sampling_params_to_pb(SamplingParams(max_tokens=num_tokens, temperature=0))
    async with grpc.aio.insecure_channel(gateway_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)

        async def one_stream(i: int) -> int:
            count = 0
            async for _ in stub.GenerateStream(generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]), sampling=sampling)):
                count += 1
            return count

        await one_stream(-1)  # warm-up
        cpu_before, start = _cpu_seconds(gateway_pid), time.perf_counter()
        counts = await asyncio.gather(*(one_stream(i) for i in range(num_streams)))
        wall, cpu = time.perf_counter() - start, _cpu_seconds(gateway_pid) - cpu_before
    total = sum(counts)
    return {"streams": num_streams, "tokens": total, "wall_s": round(wall, 3),
            "tokens_per_s": round(total / wall), "gateway_cpu_s": round(cpu, 3),
            "tokens_per_gateway_cpu_s": round(total / cpu) if cpu else None,
            "gateway_cpu_us_per_token": round(cpu / total * 1e6, 1)}


async def run(args: argparse.Namespace) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    gateway_cpu, own_cpus = ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (set(cpus), set(cpus))
    gateway = start_gateway_process(["--port", "0", "--log-level", "WARNING"], cpus=gateway_cpu,
                                    echo=False)
    os.sched_setaffinity(0, own_cpus)
    try:
        fake = FakeDecode("decode-fake", gateway.registry_address, token_ids=TOKEN_IDS, record_send_times=True,
                          model_name=load_served_model(None).name)
        await fake.start()
        try:
            latency = await measure_latency(gateway.address, fake, args.latency_requests,
                                            args.latency_tokens, args.pace_ms / 1e3)
            throughput = await measure_throughput(gateway.address, fake, gateway.process.pid,
                                                  args.streams, args.tokens)
        finally:
            await fake.stop()
    finally:
        gateway.stop()
    return {"latency": latency, "throughput": throughput, "gateway_cpus": sorted(gateway_cpu)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams (throughput)")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per stream (throughput)")
    parser.add_argument("--latency-requests", type=int, default=5)
    parser.add_argument("--latency-tokens", type=int, default=200)
    parser.add_argument("--pace-ms", type=float, default=2.0, help="gap between tokens (latency)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
