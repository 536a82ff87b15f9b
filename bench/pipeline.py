"""Pipeline parallelism with batches in flight: `pdserve bench pipeline`.

The same offline workload (greedy, fixed lengths) through three arms of the same
model: one rank in-process with every thread, PP stages in worker processes with one
batch in flight at a time, and the same stages with one batch per stage in flight
(the engine's batch queue). The two PP arms differ only in the queue, so their ratio is
what keeping every stage busy buys; the one-rank arm says what the split costs or gains
on this machine.

    pdserve bench pipeline --out docs/bench/pipeline.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.profile import machine_info, now_iso, versions
from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams


def run_arm(model: str | None, prompts: list[list[int]], params: SamplingParams, *, pp: int, threads: int,
            batch_queue: bool, max_num_batched_tokens: int, repeats: int) -> dict:
    llm = LLM(model, kv_cache_memory="256MiB", pipeline_parallel_size=pp, num_threads=threads,
              enforce_eager=True, max_num_batched_tokens=max_num_batched_tokens)
    try:
        if not batch_queue:
            llm.engine.batch_queue = None  # one batch at a time through the same stages
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=2))  # warm-up
        tok_s = []
        for _ in range(repeats):
            started = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            tok_s.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started))
        return {"pipeline_parallel_size": pp, "threads_per_rank": threads, "batch_queue": batch_queue,
                "output_tok_s": round(statistics.median(tok_s), 1), "runs_tok_s": [round(t, 1) for t in tok_s],
                "max_batches_in_flight": llm.engine.max_batches_in_flight,
                "token_ids": [o.outputs[0].token_ids for o in outputs]}
    finally:
        llm.engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or name (default: the bundled model)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--pp-size", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="step budget; below the whole workload's prompt tokens so prompts spread over batches")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per arm (the median is reported)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    prompts = [[100 + (7 * i + j) % 5000 for j in range(args.prompt_len)] for i in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    total_threads = args.pp_size
    arms = [run_arm(args.model, prompts, params, pp=1, threads=total_threads, batch_queue=False,
                    max_num_batched_tokens=args.max_num_batched_tokens, repeats=args.repeats)]
    for batch_queue in (False, True):
        arms.append(run_arm(args.model, prompts, params, pp=args.pp_size, threads=1, batch_queue=batch_queue,
                            max_num_batched_tokens=args.max_num_batched_tokens, repeats=args.repeats))
    same_tokens = all(arm.pop("token_ids") == arms[0]["token_ids"] for arm in arms[1:])
    arms[0].pop("token_ids")
    result = {"benchmark": "pipeline", "when": now_iso(), "machine": machine_info(total_threads).model_dump(),
              "versions": versions().model_dump(), "workload": {
                  "num_requests": args.num_requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
                  "max_num_batched_tokens": args.max_num_batched_tokens, "eager": True},
              "arms": arms, "same_greedy_tokens": same_tokens,
              "batch_queue_speedup": round(arms[2]["output_tok_s"] / arms[1]["output_tok_s"], 3)}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
