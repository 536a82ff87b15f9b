"""`pdserve bench cpu-attention`: one layer's CPU attention, torch path vs the native kernel.

SmolLM2-135M geometry (9 query heads, 3 KV heads, head_dim 64, block_size 16), the
cache in fp32 and bf16 (and, asked with --dtypes, bf16 queries over a cache of fp8 codes:
kv_cache_dtype fp8_e4m3 / fp8_e5m2), block tables shuffled across a cache larger than the
batch needs. Decode steps for batch 1/16/64 at context 256/1024, and a mixed step (one
prefill chunk with context plus decode rows). Each case times both paths alternately,
reps interleaved, and reports the median and min milliseconds per call (= per layer
per step), under each torch thread count asked for. On a shared machine the min is the
steadier figure: a descheduled OpenMP thread stalls every parallel region it is in,
and the torch path runs many per call.
The native kernel's build time is measured with a fresh cache directory.

--pool-pages times the native decode over a pool of 30 layers' caches (SmolLM2's depth, so
the KV comes from DRAM, as in a served step), the pool on ordinary 4 KiB pages and on huge
pages (kernels/huge_pages.py, where the engine keeps it) alternately: what the TLB costs a
step's scattered block reads.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

import torch

from kernels import decode_attention, prefill_attention
from kernels._backend import to_cache_dtype
from kernels.cpu import build
from kernels.cpu_attention import native_attention_error
from kernels.huge_pages import huge_pages_available, on_huge_pages

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM ** -0.5
# name -> (the query's and the model's dtype, the cache's)
DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
          "bf16-kv-fp8_e4m3": (torch.bfloat16, torch.float8_e4m3fn),
          "bf16-kv-fp8_e5m2": (torch.bfloat16, torch.float8_e5m2)}


def paged_cache(seq_lens: list[int], dtype: torch.dtype, gen: torch.Generator,
                cache_dtype: torch.dtype | None = None, consecutive: bool = False):
    """Random K/V cache (in cache_dtype, default dtype) with 25% spare blocks and block tables
    covering seq_lens: shuffled, or each sequence's blocks consecutive (as the engine's pool
    hands out a prompt's blocks)."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) * 5 // 4 + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    # [num_blocks, block_size, kv_heads, head_dim]
    k_cache = to_cache_dtype(torch.randn(shape, generator=gen).to(dtype), cache_dtype or dtype)
    v_cache = to_cache_dtype(torch.randn(shape, generator=gen).to(dtype), cache_dtype or dtype)
    perm = torch.arange(num_blocks) if consecutive else torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[taken:taken + n]
        taken += n
    return k_cache, v_cache, block_tables


def decode_case(batch: int, context: int, dtype: torch.dtype, gen: torch.Generator,
                cache_dtype: torch.dtype | None = None):
    k_cache, v_cache, block_tables = paged_cache([context] * batch, dtype, gen, cache_dtype)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    return lambda backend: decode_attention(q, k_cache, v_cache, block_tables, seq_lens, SCALE, backend=backend)


def mixed_case(chunk: int, chunk_context: int, num_decode: int, decode_context: int, dtype: torch.dtype,
               gen: torch.Generator, cache_dtype: torch.dtype | None = None, consecutive: bool = False):
    """One prefill chunk of `chunk` tokens after `chunk_context` cached ones, plus decode rows."""
    seq_lens = [chunk_context + chunk] + [decode_context] * num_decode
    k_cache, v_cache, block_tables = paged_cache(seq_lens, dtype, gen, cache_dtype, consecutive)
    q = torch.randn(chunk + num_decode, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + [chunk + i for i in range(num_decode + 1)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return lambda backend: prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, lens, SCALE,
                                             backend=backend)


def time_case(run, seconds: float) -> dict[str, float]:
    """Median and min ms per call of run("torch") and run("native"), reps alternating."""
    for backend in ("torch", "native"):
        run(backend)  # warm-up
    started = time.perf_counter()
    run("torch")
    reps = max(5, min(50, int(seconds / 2 / max(time.perf_counter() - started, 1e-6))))
    samples: dict[str, list[float]] = {"torch": [], "native": []}
    for _ in range(reps):
        for backend in samples:
            t0 = time.perf_counter()
            run(backend)
            samples[backend].append((time.perf_counter() - t0) * 1e3)
    result: dict[str, float] = {"reps": reps}
    for backend, times in samples.items():
        result[f"{backend}_ms"] = round(statistics.median(times), 4)
        result[f"{backend}_min_ms"] = round(min(times), 4)
    result["speedup"] = round(result["torch_ms"] / result["native_ms"], 2)
    result["speedup_min"] = round(result["torch_min_ms"] / result["native_min_ms"], 2)
    return result


POOL_LAYERS = 30


def alternating_step_ms(pools: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]], q: torch.Tensor,
                        seq_lens: torch.Tensor, reps: int) -> dict[str, list[float]]:
    """ms per layer of a decode step over each pool's layers (K cache, V cache, block tables
    each), the pools' passes alternating, two of each to warm up and then `reps`."""
    samples: dict[str, list[float]] = {name: [] for name in pools}
    for rep in range(reps + 2):
        for name, pool in pools.items():
            started = time.perf_counter()
            for k_cache, v_cache, block_tables in pool:
                decode_attention(q, k_cache, v_cache, block_tables, seq_lens, SCALE, backend="native")
            if rep >= 2:
                samples[name].append((time.perf_counter() - started) * 1e3 / len(pool))
    return samples


def pool_pages_case(batch: int, context: int, dtype: torch.dtype, gen: torch.Generator,
                    reps: int) -> dict[str, float]:
    """Median and min ms per layer of a decode step over POOL_LAYERS layers' caches, the pool
    on 4 KiB pages and a copy of it on huge pages, passes alternating."""
    layers = [paged_cache([context] * batch, dtype, gen) for _ in range(POOL_LAYERS)]
    pools = {"small_pages": layers, "huge_pages": [(on_huge_pages(k), on_huge_pages(v), t) for k, v, t in layers]}
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(dtype)  # [batch, q_heads, head_dim]
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    samples = alternating_step_ms(pools, q, seq_lens, reps)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    result: dict[str, float] = {"reps": reps}
    for name, times in samples.items():
        result[f"{name}_ms"] = round(statistics.median(times), 4)
        result[f"{name}_min_ms"] = round(min(times), 4)
        result[f"{name}_GBps"] = round(kv_bytes / statistics.median(times) / 1e6, 1)
    result["speedup"] = round(result["small_pages_ms"] / result["huge_pages_ms"], 2)
    return result


BLOCK_ORDERS = ("consecutive", "half_in_runs_of_8", "half_interleaved", "interleaved", "shuffled")


def block_order_tables(order: str, batch: int, blocks_per_seq: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, blocks_per_seq] int32 block tables over blocks 0 .. batch * blocks_per_seq - 1:
    each sequence's blocks consecutive; its first half consecutive (a prompt's) and the rest
    in runs of 8 or one block at a time across the batch (a decode step's allocations,
    with or without blocks taken ahead); all one at a time; or shuffled."""
    ids = torch.arange(batch * blocks_per_seq)
    half = blocks_per_seq // 2
    rest = blocks_per_seq - half

    def in_runs(block_ids: torch.Tensor, num_blocks: int, run: int) -> torch.Tensor:
        num_runs = -(-num_blocks // run)  # sequence s takes run r's blocks at (r * batch + s) * run
        runs = torch.arange(batch * num_runs * run).view(num_runs, batch, run).permute(1, 0, 2)
        return block_ids[0] + runs.reshape(batch, num_runs * run)[:, :num_blocks]

    if order == "consecutive":
        tables = ids.view(batch, blocks_per_seq)
    elif order in ("half_in_runs_of_8", "half_interleaved"):
        run = 8 if order == "half_in_runs_of_8" else 1
        tables = torch.cat([ids[:batch * half].view(batch, half), in_runs(ids[batch * half:], rest, run)], 1)
    elif order == "interleaved":
        tables = in_runs(ids, blocks_per_seq, 1)
    else:
        tables = ids[torch.randperm(ids.numel(), generator=gen)].view(batch, blocks_per_seq)
    return tables.to(torch.int32).contiguous()


def block_order_case(batch: int, context: int, gen: torch.Generator, reps: int) -> dict[str, float]:
    """Median ms per layer of an fp32 decode step over POOL_LAYERS layers' caches on huge
    pages, each BLOCK_ORDERS table in turn, passes alternating."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    # The runs of 8 reach past batch * blocks_per_seq blocks: the pool has room for them.
    # [num_blocks, block_size, kv_heads, head_dim]
    shape = (2 * batch * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    layers = [(on_huge_pages(torch.randn(shape, generator=gen)), on_huge_pages(torch.randn(shape, generator=gen)))
              for _ in range(POOL_LAYERS)]
    pools = {}
    for order in BLOCK_ORDERS:
        block_tables = block_order_tables(order, batch, blocks_per_seq, gen)
        pools[order] = [(k_cache, v_cache, block_tables) for k_cache, v_cache in layers]
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, generator=gen)  # [batch, q_heads, head_dim]
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    samples = alternating_step_ms(pools, q, seq_lens, reps)
    return {"reps": reps} | {f"{order}_ms": round(statistics.median(times), 4) for order, times in samples.items()}


def block_order_cases(dtype_name: str, args: argparse.Namespace, gen: torch.Generator) -> Iterator[dict]:
    """--block-order: fp32 decode steps over the pool with each request's blocks in each order."""
    if dtype_name != "fp32":
        return
    for batch, context in ((48, 200), (64, 256), (32, 512)):
        yield {"step": "decode_block_order", "dtype": dtype_name, "batch": batch, "context": context,
               "layers": POOL_LAYERS} | block_order_case(batch, context, gen, reps=max(5, int(args.seconds * 25)))


def kernel_cases(dtype_name: str, args: argparse.Namespace, gen: torch.Generator) -> Iterator[dict]:
    """Decode steps, a mixed step and any --prompts, each timed on both paths."""
    dtype, cache_dtype = DTYPES[dtype_name]
    for batch in (1, 16, 64):
        for context in (256, 1024):
            result = time_case(decode_case(batch, context, dtype, gen, cache_dtype), args.seconds)
            yield {"step": "decode", "dtype": dtype_name, "batch": batch, "context": context} | result
    result = time_case(mixed_case(256, 512, 16, 1024, dtype, gen, cache_dtype), args.seconds)
    yield {"step": "mixed", "dtype": dtype_name, "prefill_chunk": 256, "prefill_context": 512, "decode_batch": 16,
           "decode_context": 1024} | result
    consecutive = args.prompt_blocks == "consecutive"
    for prompt_len in [int(n) for n in args.prompts.split(",") if n]:
        result = time_case(mixed_case(prompt_len, args.prompt_context, 0, 0, dtype, gen, cache_dtype, consecutive),
                           args.seconds)
        yield {"step": "prompt", "dtype": dtype_name, "prompt_tokens": prompt_len,
               "prompt_context": args.prompt_context, "blocks": args.prompt_blocks} | result


def pool_pages_cases(dtype_name: str, args: argparse.Namespace, gen: torch.Generator) -> Iterator[dict]:
    """--pool-pages: decode steps over the pool on 4 KiB pages and on huge pages."""
    for batch, context in ((64, 128), (64, 256), (32, 512)):
        result = pool_pages_case(batch, context, DTYPES[dtype_name][0], gen, reps=max(5, int(args.seconds * 25)))
        yield {"step": "decode_pool", "dtype": dtype_name, "batch": batch, "context": context,
               "layers": POOL_LAYERS} | result


def build_seconds() -> float:
    with tempfile.TemporaryDirectory(prefix="pdserve-kbuild-") as cache:
        os.environ["PDSERVE_KERNEL_CACHE"] = cache
        try:
            started = time.perf_counter()
            build.build_library("paged_attention")
            return round(time.perf_counter() - started, 1)
        finally:
            del os.environ["PDSERVE_KERNEL_CACHE"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench cpu-attention", description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here (e.g. docs/bench/cpu_attention.json)")
    p.add_argument("--seconds", type=float, default=0.4, help="time budget per case, both paths")
    p.add_argument("--threads", default="1,2", help="torch thread counts to run the cases under")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, from {', '.join(DTYPES)}")
    p.add_argument("--prompts", default="", help="also whole prompts of these lengths, comma-separated "
                   "(one prefill step each, after --prompt-context cached tokens)")
    p.add_argument("--prompt-context", type=int, default=0,
                   help="the --prompts' tokens already cached (a prompt's later chunk: 0, a whole prompt)")
    p.add_argument("--prompt-blocks", choices=["shuffled", "consecutive"], default="shuffled",
                   help="the --prompts' blocks anywhere in the cache, or in one run (as the engine's pool "
                        "mostly hands out a prompt's blocks)")
    p.add_argument("--no-build-time", action="store_true", help="skip timing a fresh build of the kernel")
    p.add_argument("--pool-pages", action="store_true", help="instead: decode steps over 30 layers' pool on "
                   "4 KiB pages against huge pages (batch 32/64, context 128/256/512)")
    p.add_argument("--block-order", action="store_true", help="instead: fp32 decode steps over 30 layers' pool "
                   "(huge pages) with each sequence's blocks consecutive, half in runs of 8 or interleaved, all "
                   "interleaved, or shuffled (batch 32-64, context 200-512)")
    p.add_argument("--note", default="", help="conditions worth recording with the figures (e.g. a shared machine)")
    args = p.parse_args(argv)
    if args.prompt_context < 0:
        p.error(f"--prompt-context must be at least 0, got {args.prompt_context}")
    if native_attention_error() is not None:
        print(f"native CPU attention unavailable: {native_attention_error()}", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    load_before = os.getloadavg()
    if (args.pool_pages or args.block_order) and not huge_pages_available():
        print("no transparent huge pages here (THP never, or PDSERVE_HUGE_PAGES=0)", file=sys.stderr)
        return 1
    cases_of = pool_pages_cases if args.pool_pages else block_order_cases if args.block_order else kernel_cases
    cases = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for dtype_name in args.dtypes.split(","):
            for case in cases_of(dtype_name, args, gen):
                cases.append({"threads": threads} | case)
                print(json.dumps(cases[-1]), flush=True)
    results = {
        "command": "pdserve bench cpu-attention " + " ".join(argv if argv is not None else sys.argv[1:]),
        "geometry": {"num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                     "block_size": BLOCK_SIZE, "model": "SmolLM2-135M"},
        "unit": "ms per attention call (one layer, one step): median and min over reps",
        "machine_threads": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "note": args.note,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "build_seconds": None if args.no_build_time or args.pool_pages or args.block_order else build_seconds(),
        "cases": cases,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
    print(json.dumps({k: v for k, v in results.items() if k != "cases"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
