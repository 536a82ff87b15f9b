"""`pdserve bench serve-embed`: /v1/embeddings served by pdserve and by `vllm serve`, one after the other.

Each server gets the machine alone, the same model directory, dtype and context length:
pdserve in its best configuration for a small machine (`pdserve up --prefill 0 --decode 1`: the
lone decode instance computes the embeddings, with every core for those steps), vLLM serving the
checkpoint as an embedding model (`--runner pooling --convert embed`). One client in this
process sends both the same seeded requests (one input of random token ids each) with at most
--concurrency requests in flight, for each concurrency given. Reported per concurrency and side:
requests/s, prompt tokens/s, latency p50 and p99, and the throughput ratio.

    pdserve bench serve-embed --concurrency 1,8,32 --num-requests 256 --json docs/bench/serve_embed.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.embed import VLLM_POOLING_TYPES, workload
from bench.peers.vllm_peer import cpu_env, preload_choice, vllm_python
from bench.peers.vllm_serve import free_port, resolve_dtype, serving


async def _load(base_url: str, model: str, prompts: list[list[int]], concurrency: int) -> dict:
    """Every prompt embedded once, at most `concurrency` at a time: rates and latencies."""
    import aiohttp
    latencies: list[float] = []
    limit = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        async with limit:
            t0 = time.perf_counter()
            async with session.post(f"{base_url}/v1/embeddings", json={
                    "model": model, "input": prompt, "encoding_format": "float"}) as response:
                body = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"{base_url}: {response.status} {body}")
            assert len(body["data"][0]["embedding"]) > 0
            latencies.append(time.perf_counter() - t0)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await one(session, prompts[0])  # a warm connection and engine
        latencies.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in prompts))
        seconds = time.perf_counter() - t0
    latencies.sort()
    return {"concurrency": concurrency, "seconds": seconds, "requests_per_s": len(prompts) / seconds,
            "prompt_tokens_per_s": sum(len(p) for p in prompts) / seconds,
            "latency_p50_s": statistics.median(latencies),
            "latency_p99_s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]}


def _run_loads(base_url: str, model: str, prompt_sets: dict[int, list[list[int]]]) -> list[dict]:
    return [asyncio.run(_load(base_url, model, prompts, concurrency)) for concurrency, prompts in prompt_sets.items()]


def serve_ours(args: argparse.Namespace, model_dir: str, out: Path, prompt_sets) -> list[dict]:
    from common.cli.up import LocalStack
    passthrough = ["--model", model_dir, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                   "--kv-cache-memory", args.kv_cache_memory, "--log-level", "WARNING"]
    if args.max_num_batched_tokens is not None:
        passthrough += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    passthrough += ["--pooler-config", json.dumps({"pooling_type": args.pooling_type})]
    (out / "pdserve-logs").mkdir()
    with LocalStack(0, 1, http_port=0, passthrough=passthrough, log_dir=out / "pdserve-logs",
                    startup_timeout_s=args.startup_timeout, reserved_cpus=args.reserved_cpus) as stack:
        return _run_loads(f"http://{stack.http_address}", Path(model_dir).name, prompt_sets)


def serve_vllm(args: argparse.Namespace, model_dir: str, out: Path, python: Path, preload: list[str],
               prompt_sets) -> list[dict]:
    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", Path(model_dir).name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--runner", "pooling",
            "--convert", "embed", "--pooler-config", json.dumps({"pooling_type": args.pooling_type})]
    if args.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    from common.engine.config import parse_memory_size
    env = cpu_env(args.peer_threads_bind, parse_memory_size(args.kv_cache_memory) / (1 << 30), preload)
    with serving(argv, port, out / "vllm-serve.log", env, args.startup_timeout) as (base_url, _):
        return _run_loads(base_url, Path(model_dir).name, prompt_sets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench serve-embed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto",
                        help="both servers' (auto: bf16 where the CPU computes it natively, else float32; "
                             "named to vLLM, which takes no 'auto' for CPU pooling)")
    parser.add_argument("--concurrency", default="1,8,32", help="requests in flight at most, comma-separated")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="both servers' step budget (default: each one's own, 2,048 on both for a CPU server)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=1800)
    parser.add_argument("--peer-venv", default=None)
    parser.add_argument("--peer-threads-bind", default="all")
    parser.add_argument("--peer-preload", choices=["auto", "none"], default="auto")
    parser.add_argument("--reserved-cpus", type=int, default=None,
                        help="`pdserve up --reserved-cpus` for our stack: cores left out of the engines' share "
                             "(default: up's, 1 on hosts of 8 CPUs or more, else 0)")
    parser.add_argument("--skip-vllm", action="store_true", help="pdserve alone")
    parser.add_argument("--pooling-type", choices=VLLM_POOLING_TYPES, default="LAST",
                        help="both servers' pooling (--pooler-config's pooling_type; those vLLM 0.32 has)")
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    try:
        args.dtype = resolve_dtype(args.dtype)
    except ValueError as e:
        parser.error(str(e))
    if args.num_requests < 1 or min(concurrencies) < 1 or args.max_prompt >= args.max_model_len:
        parser.error("--num-requests and each --concurrency must be >= 1, --max-prompt below --max-model-len")

    from common.engine.model_files import load_hf_config, resolve_model
    model_dir = str(resolve_model(args.model))
    vocab_size = load_hf_config(Path(model_dir))["vocab_size"]
    python = None if args.skip_vllm else vllm_python(args.peer_venv)
    # Each concurrency its own prompts: no side is helped by a prefix it cached in an earlier load.
    prompt_sets = {c: workload(args.num_requests, args.min_prompt, args.max_prompt, vocab_size, args.seed + i)
                   for i, c in enumerate(concurrencies)}
    results: dict = {"config": vars(args)}
    with tempfile.TemporaryDirectory(prefix="serve-embed-") as tmp:
        out = Path(tmp)
        results["pdserve"] = serve_ours(args, model_dir, out, prompt_sets)
        if python is not None:
            results["vllm"] = serve_vllm(args, model_dir, out, python, preload_choice(args.peer_preload, python),
                                         prompt_sets)
    for i, ours in enumerate(results["pdserve"]):
        line = (f"concurrency {ours['concurrency']}: pdserve {ours['requests_per_s']:.1f} req/s "
                f"(p50 {ours['latency_p50_s'] * 1000:.0f} ms, p99 {ours['latency_p99_s'] * 1000:.0f} ms)")
        if "vllm" in results:
            theirs = results["vllm"][i]
            ours["ratio"] = ours["requests_per_s"] / theirs["requests_per_s"]
            line += (f", vLLM {theirs['requests_per_s']:.1f} req/s (p50 {theirs['latency_p50_s'] * 1000:.0f} ms, "
                     f"p99 {theirs['latency_p99_s'] * 1000:.0f} ms): {ours['ratio']:.2f}x")
        print(line, flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
