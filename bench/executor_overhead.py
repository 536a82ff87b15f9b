"""What the multi-process executor costs per step at TP 1: `pdserve bench executor`.

The same decode steps (batch 1, 8, 32 by default; every row one token at a fixed
context length) run through the in-process executor (uni) and through one worker
process (mp), interleaved step by step so both see the same machine load; the
difference of the medians is the shared-memory queue, the msgpack codecs and the
process hop. An empty step through each isolates that round trip.

    pdserve bench executor --out docs/bench/executor.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench.profile import machine_info, now_iso, versions
from common.engine.config import ModelConfig, ParallelConfig, make_engine_config
from common.engine.executor import InProcessExecutor
from common.engine.executor.multiproc import MultiProcExecutor
from common.engine.model_files import load_hf_config, resolve_model
from common.engine.outputs import ScheduledRequest, SchedulerOutput
from common.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=1_000_000, ignore_eos=True)


def decode_step(batch_size: int, context_len: int, block_size: int) -> SchedulerOutput:
    """batch_size rows, each decoding one token after context_len tokens, in disjoint blocks."""
    blocks_per_row = -(-(context_len + 1) // block_size)
    scheduled = [ScheduledRequest(req_id=f"r{row}", token_ids=[100 + row], start_pos=context_len,
                                  block_table=list(range(row * blocks_per_row, (row + 1) * blocks_per_row)),
                                  do_sample=True, sampling_params=GREEDY,
                                  prompt_token_ids=[100] * context_len, output_token_ids=[])
                 for row in range(batch_size)]
    return SchedulerOutput(scheduled, num_scheduled_tokens=batch_size)


def time_steps(executors: dict, step: SchedulerOutput, num_steps: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {name: [] for name in executors}
    for name, executor in executors.items():  # warm-up
        executor.execute_model(step)
    for _ in range(num_steps):
        for name, executor in executors.items():
            started = time.perf_counter()
            executor.execute_model(step)
            seconds[name].append(time.perf_counter() - started)
    return seconds


def summary_ms(samples: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(samples) * 1e3, 4),
            "p90_ms": round(sorted(samples)[int(0.9 * (len(samples) - 1))] * 1e3, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench executor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or name (default: the bundled model)")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--context-len", type=int, default=64, help="tokens before each decoded one")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per batch size and executor")
    parser.add_argument("--empty-steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each executor's runner")
    parser.add_argument("--compile", action="store_true",
                        help="compile the forward pass (default: eager; the executor's cost is the same)")
    parser.add_argument("--tp-sizes", default="",
                        help="also time mp executors at these tensor-parallel sizes (e.g. 3: the bundled "
                             "model's 9 query and 3 KV heads allow 1 and 3), each rank --threads threads")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    load_at_start = round(os.getloadavg()[0], 2)  # other work on the machine skews both columns alike

    import torch
    torch.set_num_threads(args.threads)  # the in-process runner's; the worker applies num_threads itself
    config = make_engine_config(args.model, num_threads=args.threads, distributed_executor_backend="mp",
                                enforce_eager=not args.compile)
    model_dir = resolve_model(args.model)
    model_config = ModelConfig.from_hf_config(load_hf_config(model_dir))
    block_size = config.cache.block_size
    num_blocks = max(batch_sizes) * -(-(args.context_len + 1) // block_size)
    executors = {"uni": InProcessExecutor(model_config, model_dir, config),
                 "mp": MultiProcExecutor(model_config, model_dir, config)}
    tp_sizes = [int(t) for t in args.tp_sizes.split(",") if t.strip()]
    for tp_size in tp_sizes:
        executors[f"mp-tp{tp_size}"] = MultiProcExecutor(model_config, model_dir, config.replace(
            parallel=ParallelConfig(tensor_parallel_size=tp_size, distributed_executor_backend="mp")))
    try:
        for executor in executors.values():
            executor.allocate_kv_cache(num_blocks)
            executor.collective_rpc("warm_up")
        empty = time_steps(executors, SchedulerOutput([], 0), args.empty_steps)
        rows = []
        for batch_size in batch_sizes:
            seconds = time_steps(executors, decode_step(batch_size, args.context_len, block_size), args.steps)
            uni, mp = summary_ms(seconds["uni"]), summary_ms(seconds["mp"])
            rows.append({"batch_size": batch_size, "uni": uni, "mp": mp,
                         "overhead_ms": round(mp["median_ms"] - uni["median_ms"], 4),
                         "overhead_pct": round(100 * (mp["median_ms"] / uni["median_ms"] - 1), 1),
                         **{f"mp-tp{t}": summary_ms(seconds[f"mp-tp{t}"]) for t in tp_sizes}})
    finally:
        for executor in executors.values():
            executor.shutdown()
    result = {
        "bench": "executor", "date": now_iso(), "model": str(model_dir), "context_len": args.context_len,
        "num_steps": args.steps, "machine": machine_info(args.threads).model_dump(),
        "versions": versions().model_dump(),
        "load_average_1m": {"start": load_at_start, "end": round(os.getloadavg()[0], 2)},
        "empty_step": {"uni_us": round(statistics.median(empty["uni"]) * 1e6, 1),
                       "mp_us": round(statistics.median(empty["mp"]) * 1e6, 1),
                       "mp_p90_us": round(sorted(empty["mp"])[int(0.9 * (len(empty["mp"]) - 1))] * 1e6, 1)},
        "decode_steps": rows,
    }
    print(f"empty step (queue round trip): uni {result['empty_step']['uni_us']} us, "
          f"mp {result['empty_step']['mp_us']} us (p90 {result['empty_step']['mp_p90_us']} us)")
    print(f"{'batch':>6} {'uni ms':>10} {'mp ms':>10} {'overhead ms':>12} {'overhead %':>11}")
    for row in rows:
        print(f"{row['batch_size']:>6} {row['uni']['median_ms']:>10.3f} {row['mp']['median_ms']:>10.3f} "
              f"{row['overhead_ms']:>12.3f} {row['overhead_pct']:>11.1f}"
              + "".join(f"  tp{t} {row[f'mp-tp{t}']['median_ms']:.3f} ms" for t in tp_sizes))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
