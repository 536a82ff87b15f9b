"""`pdserve bench quant`: quantized weights (gguf Q4_1, int8) and KV caches (fp8) against the dense model on CPU.

Arms: the unquantized model in fp32 and bf16, each quantization with fp32 and bf16 for
everything it leaves dense (embedding, tied LM head, norms, attention), and the KV cache in
8-bit float codes (kv_cache_dtype fp8 = E4M3, fp8_e5m2) under bf16. Per arm: single-stream
decode tokens/s (a request's time at max_tokens minus its time at one token, both with the
prefix cache emptied first, over the tokens in between), a short greedy batch's output
tokens/s, greedy agreement with dense fp32 on that batch (tokens until the first divergence,
and whole sequences equal), and perplexity on a fixed paragraph through the engine's own
model (one teacher-forced forward). Arms run interleaved request by request, so drift on a
shared machine hits all of them alike. Each arm compiles its model unless --enforce-eager
(minutes per arm on a small shared CPU); perplexity runs the eager model. With
--ttft-tokens, each arm's time to first token of a prompt of random tokens of each length.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

PROMPTS = ["Write a short poem about autumn.", "What are three tips for learning a new language?",
           "Explain what a rainbow is to a child.", "Suggest a name for a bakery and say why.",
           "Describe your ideal weekend.", "Why do cats purr?", "Give me a recipe idea with eggs.",
           "What is the difference between weather and climate?"]
PERPLEXITY_TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe experimented "
    "with two-wheeled machines that riders pushed along with their feet. These early designs were heavy, "
    "uncomfortable and difficult to steer, yet they caught the public imagination and were soon seen in parks "
    "and on city streets. Over the following decades, engineers added pedals to the front wheel, then moved the "
    "drive to the rear wheel with a chain, and finally fitted air-filled rubber tyres that made the ride far "
    "smoother. By the end of the century the safety bicycle, with two wheels of equal size, had become the "
    "standard form that we still recognise today. The bicycle changed daily life in many ways. Workers could "
    "live farther from factories and offices, young people gained a new kind of freedom, and women in particular "
    "found in cycling a practical means of independent travel, which in turn influenced fashion and social "
    "customs. Cycling clubs organised long tours through the countryside, and road surfaces improved as riders "
    "campaigned for better streets, years before the motor car arrived to take advantage of them. Today the "
    "bicycle remains one of the most efficient machines ever built for moving a person from one place to "
    "another. It needs no fuel beyond the rider's own energy, it takes up little space, and it can be repaired "
    "with simple tools. Many cities now build protected lanes and offer shared bicycles, hoping to reduce "
    "traffic, cut pollution and encourage people to lead healthier lives.")
# name -> (quantization, dtype, kv_cache_dtype)
ARMS = {"none-fp32": (None, "float32", "auto"), "none-bf16": (None, "bfloat16", "auto"),
        "gguf-fp32": ("gguf", "float32", "auto"), "gguf-bf16": ("gguf", "bfloat16", "auto"),
        "int8-fp32": ("int8", "float32", "auto"), "int8-bf16": ("int8", "bfloat16", "auto"),
        "none-bf16-kvfp8": (None, "bfloat16", "fp8"), "none-bf16-kve5m2": (None, "bfloat16", "fp8_e5m2"),
        "gguf-bf16-kvfp8": ("gguf", "bfloat16", "fp8")}
REFERENCE_ARM = "none-fp32"


def model_bytes(model: torch.nn.Module) -> int:
    """Weights (packed linears included, the packed copy of a tied head once) and buffers."""
    from common.engine.models.prepacked_linear import model_weight_bytes
    return model_weight_bytes(model) + sum(t.numel() * t.element_size() for t in model.buffers())


@torch.inference_mode()
def perplexity(llm, text: str) -> float:
    """exp(mean next-token NLL) of `text`, one forward of the engine's model over private KV blocks."""
    from common.engine.model_runner import allocate_paged_kv
    from common.engine.outputs import ScheduledRequest
    from common.engine.sampling_params import SamplingParams
    runner = llm.engine.executor.runner
    token_ids = llm.tokenizer.encode(text)
    num_blocks = -(-len(token_ids) // runner.block_size)
    kv_caches = allocate_paged_kv(runner.model_config, num_blocks, runner.block_size, runner.kv_cache_dtype,
                                  runner.device)
    request = ScheduledRequest(req_id="ppl", token_ids=token_ids, start_pos=0, block_table=list(range(num_blocks)),
                               do_sample=False, sampling_params=SamplingParams())
    input_ids, positions, meta, _, _ = runner.prepare_inputs([request])
    hidden = runner.model(input_ids, positions, kv_caches, meta)  # [num_tokens, hidden]
    logits = runner.model.compute_logits(hidden)  # [num_tokens, vocab] fp32
    return math.exp(F.cross_entropy(logits[:-1], input_ids[1:]).item())


def leading_equal(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def timed_chat(llm, prompts: list, params) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, [o.outputs[0].token_ids for o in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench quant", description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--num-decode-prompts", type=int, default=4, help="single-stream requests per arm")
    parser.add_argument("--decode-tokens", type=int, default=64, help="max_tokens of a single-stream request")
    parser.add_argument("--num-batch-prompts", type=int, default=8, help="batch size of the batch and agreement run")
    parser.add_argument("--batch-tokens", type=int, default=32, help="greedy tokens per batch request")
    parser.add_argument("--ttft-tokens", default="",
                        help="comma-separated prompt lengths: time to first token of a prompt of random tokens per "
                             "arm (best of the last 3 of 4, prefix cache emptied), e.g. 64,256,1024")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads; default torch's choice")
    parser.add_argument("--enforce-eager", action="store_true", help="run every arm eagerly (no torch.compile)")
    parser.add_argument("--json", default="docs/bench/quant.json", help="write the figures here ('' for none)")
    parser.add_argument("--note", default="", help="conditions of the run, kept in the JSON (e.g. a shared host)")
    args = parser.parse_args(argv)

    from bench.profile import cpu_model_name
    from common import LLM, SamplingParams
    from kernels.cpu_attention import DTYPES_ENV
    # One process, engines of several dtypes: the attention library (built once per process for
    # the dtypes named before it loads) must hold them all, or the later arms take the torch path.
    os.environ.setdefault(DTYPES_ENV, "all")
    arm_names = args.arms.split(",")
    if REFERENCE_ARM not in arm_names:
        arm_names.insert(0, REFERENCE_ARM)
    llms, figures = {}, {}
    for name in arm_names:
        quantization, dtype, kv_cache_dtype = ARMS[name]
        started = time.perf_counter()
        llms[name] = LLM(quantization=quantization, dtype=dtype, kv_cache_memory="128MiB",
                         num_threads=args.num_threads, enforce_eager=args.enforce_eager, kv_cache_dtype=kv_cache_dtype)
        figures[name] = {"quantization": quantization, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
                         "load_s": round(time.perf_counter() - started, 2),
                         "weights_mib": round(model_bytes(llms[name].engine.executor.runner.model) / 2**20, 1)}
        progress(f"loaded {name} in {figures[name]['load_s']} s")
    for llm in llms.values():  # warm-up
        llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0.0, max_tokens=4))

    one = SamplingParams(temperature=0.0, max_tokens=1)
    full = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    decode_s = dict.fromkeys(llms, 0.0)
    for prompt in PROMPTS[:args.num_decode_prompts]:
        conversation = [[{"role": "user", "content": prompt}]]
        for name, llm in llms.items():
            # Both runs compute the whole prompt, so their difference is the decode steps
            # alone: a cached prompt in the second would count prefill time as decode time.
            llm.reset_prefix_cache()
            t_full, _ = timed_chat(llm, conversation, full)
            llm.reset_prefix_cache()
            t_one, _ = timed_chat(llm, conversation, one)
            decode_s[name] += t_full - t_one
        progress(f"single-stream: {prompt!r} through every arm")
    num_decode_tokens = args.num_decode_prompts * (args.decode_tokens - 1)

    batch = [[{"role": "user", "content": p}] for p in PROMPTS[:args.num_batch_prompts]]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.batch_tokens, ignore_eos=True)
    batch_token_ids = {}
    for name, llm in llms.items():
        seconds, batch_token_ids[name] = timed_chat(llm, batch, greedy)
        figures[name]["batch_tokens_per_s"] = round(sum(map(len, batch_token_ids[name])) / seconds, 1)
        figures[name]["decode_tokens_per_s"] = round(num_decode_tokens / decode_s[name], 1)
        figures[name]["perplexity"] = round(perplexity(llm, PERPLEXITY_TEXT), 3)
        progress(f"batch and perplexity: {name}")
    for length in [int(n) for n in args.ttft_tokens.split(",") if n]:
        for name, llm in llms.items():
            figures[name].setdefault("ttft_ms", {})[str(length)] = round(1e3 * time_to_first_token(llm, length), 1)
        progress(f"time to first token: {length} tokens through every arm")
    reference = batch_token_ids[REFERENCE_ARM]
    for name in llms:
        pairs = list(zip(batch_token_ids[name], reference))
        figures[name]["greedy_agreement"] = round(
            sum(leading_equal(a, b) for a, b in pairs) / sum(len(b) for _, b in pairs), 3)
        figures[name]["whole_sequence_matches"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    for llm in llms.values():
        llm.engine.shutdown()

    result = {"cpu": cpu_model_name(), "torch_threads": torch.get_num_threads(), "note": args.note,
              "compiled": not args.enforce_eager,
              "reference": REFERENCE_ARM, "num_decode_prompts": args.num_decode_prompts,
              "decode_tokens": args.decode_tokens, "num_batch_prompts": args.num_batch_prompts,
              "batch_tokens": args.batch_tokens, "perplexity_text_tokens": len(
                  llms[REFERENCE_ARM].tokenizer.encode(PERPLEXITY_TEXT)), "arms": figures}
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def time_to_first_token(llm, num_tokens: int, runs: int = 4) -> float:
    """Seconds to the first token of a prompt of random ordinary tokens, best of the last
    runs - 1 (the first may build or page in what the rest reuse), each prompt new."""
    from common import SamplingParams
    rng = random.Random(num_tokens)
    vocab_size = llm.engine.model_config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1)
    seconds = []
    for _ in range(runs):
        prompt = [rng.randrange(100, vocab_size) for _ in range(num_tokens)]
        llm.reset_prefix_cache()
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
    return min(seconds[1:])


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def print_table(result: dict) -> None:
    print(f"CPU: {result['cpu']} ({result['torch_threads']} torch threads); agreement vs {result['reference']} "
          f"over {result['num_batch_prompts']} prompts x {result['batch_tokens']} greedy tokens; perplexity over "
          f"{result['perplexity_text_tokens']} tokens")
    columns = ["arm", "load_s", "weights_mib", "decode_tokens_per_s", "batch_tokens_per_s", "greedy_agreement",
               "whole_sequence_matches", "perplexity"]
    rows = [[name] + [str(arm[c]) for c in columns[1:]] for name, arm in result["arms"].items()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    for row in [columns, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    for name, arm in result["arms"].items():
        if arm.get("ttft_ms"):
            times = ", ".join(f"{n} tokens {ms} ms" for n, ms in arm["ttft_ms"].items())
            print(f"{name}: time to first token {times}")
