"""How long a single stream's decode step takes in a warm engine: the median and 10th
percentile of the model runner's forward (`ModelRunner._run_model`) over 5 x 128 tokens,
and the stream's median tokens/s. Medians of many steps are steadier than a stream's
tokens/s on a shared machine; compare builds by alternating processes.

    .venv/bin/python scripts/time_decode_steps.py [--quantization gguf] [--dtype float32]
"""
import argparse
import statistics
import time

from bench.offline import single_stream
from common.engine.llm import LLM

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--quantization", default=None, help="gguf or int8; default dense")
parser.add_argument("--dtype", default="auto")
parser.add_argument("--num-streams", type=int, default=5, help="single-stream runs of 128 tokens")
args = parser.parse_args()
llm = LLM(quantization=args.quantization, dtype=args.dtype, kv_cache_memory="128MiB")
runner = llm.engine.executor.runner
step_seconds: list[float] = []
run_model = runner._run_model


def timed_run_model(*call_args, **call_kwargs):
    started = time.perf_counter()
    out = run_model(*call_args, **call_kwargs)
    step_seconds.append(time.perf_counter() - started)
    return out


runner._run_model = timed_run_model
prompt = list(range(1000, 1016))
single_stream(llm, prompt, 32)  # warm-up
step_seconds.clear()
rates = [single_stream(llm, prompt, 128) for _ in range(args.num_streams)]
print(f"{args.quantization or 'dense'} {args.dtype}: step median {statistics.median(step_seconds) * 1e3:.2f} ms, "
      f"p10 {statistics.quantiles(step_seconds, n=10)[0] * 1e3:.2f} ms over {len(step_seconds)} steps; "
      f"single stream median {statistics.median(rates):.1f} tok/s")
