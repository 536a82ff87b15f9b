"""Where a single stream's decode step goes on a GPU (warm engine, CUDA graphs on): tok/s, a
torch.profiler table of host and kernel time, cProfile of the host, and the bare replay time
of the batch-1 and batch-64 decode graphs. Run from the repository root on a CUDA machine."""
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.offline import make_workload, single_stream
from common.engine.llm import LLM

llm = LLM(dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory="2GiB")
prompt = make_workload(1, 0, llm.engine.model_config.vocab_size, 16, 16, 8, 8)[0][0]
for _ in range(3):
    print(f"single stream (warm): {single_stream(llm, prompt, 256):.1f} tok/s", flush=True)
PROFILED_TOKENS = 128
# single_stream generates 4 tokens to warm up, then the timed ones: one step per token.
num_steps = 4 + PROFILED_TOKENS
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    started = time.perf_counter()
    single_stream(llm, prompt, PROFILED_TOKENS)
    wall = time.perf_counter() - started
events = prof.key_averages()
cuda_us = sum(e.self_device_time_total for e in events)
print(f"profiled: {wall * 1e3 / num_steps:.3f} ms/step wall; GPU busy {cuda_us / 1e3 / num_steps:.3f} ms/step")
print(events.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=48))
print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=48))
pr = cProfile.Profile(); pr.enable(); single_stream(llm, prompt, 256); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28); print(s.getvalue()[:8000])
graphs = llm.engine.executor.runner.decode_graphs
for size in (1, 64):
    replay, _ = graphs._graphs[size]
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(200):
        replay()
    launched = time.perf_counter() - t0; torch.cuda.synchronize(); done = time.perf_counter() - t0
    print(f"bucket-{size} graph (forward + logits): host {launched / 200 * 1e3:.3f} ms per launch, "
          f"{done / 200 * 1e3:.3f} ms per replay back to back")
