"""`pdserve bench embed`: embeddings offline, pdserve's `LLM.embed` against vLLM's pooling runner.

    pdserve bench embed --peer vllm --peer-threads-bind all --json docs/bench/embed.json

The same seeded prompts (--num-prompts random token ids, lengths uniform in
[--min-prompt, --max-prompt]) embedded whole on each side, --repeats timed passes
alternating ours and vLLM's (`LLM(model_dir, runner="pooling", convert="embed")`, in its own
venv: bench/peers/vllm_embed_runner.py), both in the same dtype, with prefix caching off so
every pass computes every prompt, each pass started once the other side is quiet. Reported:
prompts/s and prompt tokens/s (median pass), the ratio (and each pair's), and how the vectors
agree (cosine of each prompt's two embeddings: both sides pool the final hidden states as
--pooling-type says, the last token's by default, and normalize).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

from bench.peers.proc_cpu import wait_until_quiet
from common.engine.scoring import cosine_similarity

# The poolings both sides can run (--pooler-config's pooling_type): those vLLM 0.32 has.
VLLM_POOLING_TYPES = ("LAST", "MEAN", "CLS")


def workload(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids above the first thousand: clear of the special tokens every vocabulary starts with.
    return [[rng.randrange(1000, vocab_size) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_prompts)]


def rates(seconds: list[float], num_prompts: int, num_tokens: int) -> dict:
    median = statistics.median(seconds)
    return {"seconds": seconds, "prompts_per_s": num_prompts / median, "prompt_tokens_per_s": num_tokens / median}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench embed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", dest="json_path", default=None, help="write every figure here")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", help="both sides (auto: the engine's choice, given to vLLM)")
    parser.add_argument("--peer", choices=["vllm", "none"], default="vllm")
    parser.add_argument("--peer-venv", default=None, help="vLLM's venv (default .venv-vllm, $PDSERVE_VLLM_VENV)")
    parser.add_argument("--peer-threads-bind", default="auto", help="vLLM's VLLM_CPU_OMP_THREADS_BIND: auto or all")
    parser.add_argument("--peer-preload", choices=["auto", "none"], default="auto",
                        help="vLLM's LD_PRELOAD (bench offline's option)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--num-vectors", type=int, default=32, help="prompts whose two embeddings are compared")
    parser.add_argument("--pooling-type", choices=VLLM_POOLING_TYPES, default="LAST",
                        help="both sides' pooling (--pooler-config's pooling_type; those vLLM 0.32 has)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.num_prompts < 1 or not 1 <= args.min_prompt <= args.max_prompt:
        parser.error("--repeats and --num-prompts must be >= 1 and 1 <= --min-prompt <= --max-prompt")

    from bench.profile import cpu_model_name
    from common.engine.llm import LLM
    from common.engine.model_files import resolve_model

    vllm_python = None
    if args.peer == "vllm":  # fail before our own run, not after
        from bench.peers.vllm_peer import vllm_python as find_vllm
        vllm_python = find_vllm(args.peer_venv)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
              enable_prefix_caching=False, pooler_config={"pooling_type": args.pooling_type})
    runner = llm.engine.executor.runner
    dtype = str(runner.dtype).removeprefix("torch.")
    prompts = workload(args.num_prompts, args.min_prompt, args.max_prompt, llm.engine.model_config.vocab_size,
                       args.seed)
    num_tokens = sum(len(p) for p in prompts)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    results: dict = {"config": vars(args), "dtype": dtype, "num_prompt_tokens": num_tokens,
                     "machine": {"platform": platform.platform(), "cpu": cpu_model_name()}}
    llm.embed(inputs[:2])  # warm-up
    ours, theirs, ours_vectors, their_vectors = [], [], [], []
    with ExitStack() as stack:
        peer = None
        if vllm_python is not None:
            from bench.peers.vllm_peer import OfflinePeer, preload_choice
            preload = preload_choice(args.peer_preload, vllm_python)
            kv_cache_gib = llm.engine.config.cache.num_blocks * llm.engine.executor.kv_bytes_per_block() / (1 << 30)
            log_path = Path(args.json_path or "bench-embed").with_suffix(".vllm.log")
            spec = {"model_dir": str(resolve_model(args.model)), "dtype": dtype, "prompts": prompts,
                    "max_model_len": args.max_prompt + 16, "max_num_seqs": args.max_num_seqs,
                    "max_num_batched_tokens": args.max_num_batched_tokens, "pooling_type": args.pooling_type}
            peer = stack.enter_context(OfflinePeer(
                vllm_python, spec, args.peer_threads_bind, kv_cache_gib, log_path, start_timeout_s=1800,
                preload=preload, runner=Path(__file__).parent / "peers" / "vllm_embed_runner.py"))
            results["vllm"] = {"vllm_version": peer.ready["vllm_version"], "threads_bind": args.peer_threads_bind,
                               "preload": preload, "log": str(log_path)}
        quiet_waits = []

        def let_settle(before: str) -> None:
            """A timed pass starts once the other side is quiet (vLLM keeps a core busy for about
            a second after each call: bench/peers/proc_cpu.py), as bench offline's do."""
            if peer is not None:
                other, exclude = (peer.pid, ()) if before == "ours" else (os.getpid(), (peer.pid,))
                waited, quiet = wait_until_quiet(other, exclude)
                quiet_waits.append({"before": before, "seconds": waited, "quiet": quiet})

        def ours_pass() -> None:
            nonlocal ours_vectors
            let_settle("ours")
            t0 = time.perf_counter()
            outputs = llm.embed(inputs)
            ours.append(time.perf_counter() - t0)
            ours_vectors = [o.outputs.embedding for o in outputs[:args.num_vectors]]
            print(f"pass {len(ours)}: ours {ours[-1]:.2f} s", flush=True)

        def vllm_pass() -> None:
            nonlocal their_vectors
            let_settle("vllm")
            answer = peer.call("embed", timeout_s=1800, num_vectors=0 if theirs else args.num_vectors)
            theirs.append(answer["seconds"])
            their_vectors = answer["vectors"] or their_vectors
            print(f"pass {len(theirs)}: vLLM {theirs[-1]:.2f} s", flush=True)

        # Each pair of passes in the other order from the last, so the host's drift lands on both.
        for repeat in range(args.repeats):
            sides = ([ours_pass] if peer is None else [ours_pass, vllm_pass] if repeat % 2 == 0
                     else [vllm_pass, ours_pass])
            for side in sides:
                side()
        results["quiet_waits"] = quiet_waits
    results["ours"] = rates(ours, len(prompts), num_tokens)
    print(f"pdserve ({dtype}): {results['ours']['prompts_per_s']:.1f} prompts/s, "
          f"{results['ours']['prompt_tokens_per_s']:.0f} prompt tokens/s")
    if theirs:
        results["vllm"] |= rates(theirs, len(prompts), num_tokens)
        cosines = [cosine_similarity(a, b) for a, b in zip(ours_vectors, their_vectors)]
        results["agreement"] = {"min_cosine": min(cosines), "median_cosine": statistics.median(cosines),
                                "num_vectors": len(cosines)}
        results["ratio"] = results["ours"]["prompts_per_s"] / results["vllm"]["prompts_per_s"]
        results["pass_ratios"] = [t / o for o, t in zip(ours, theirs)]
        print(f"vLLM {results['vllm']['vllm_version']}: {results['vllm']['prompts_per_s']:.1f} prompts/s, "
              f"{results['vllm']['prompt_tokens_per_s']:.0f} prompt tokens/s; pdserve / vLLM "
              f"{results['ratio']:.2f}x; cosine min {results['agreement']['min_cosine']:.5f}, "
              f"median {results['agreement']['median_cosine']:.5f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2) + "\n")
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
