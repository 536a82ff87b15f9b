"""Runs inside vLLM's own venv (not pdserve's): the offline workload through vllm.LLM.

`pdserve bench offline --peer vllm` starts this file with that venv's python and reads
one JSON line back. It imports nothing from pdserve, since pdserve is not installed
there; the workload arrives as JSON on stdin (the prompts' token ids and max_tokens).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

from proc_memory import tree_memory  # beside this file (this script's directory leads sys.path)


def main() -> int:
    spec = json.load(sys.stdin)
    from vllm import LLM, SamplingParams

    llm = LLM(spec["model_dir"], dtype=spec["dtype"], seed=spec["seed"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=False)
    workload = spec["workload"]  # [[prompt_token_ids, max_tokens], ...]
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in workload]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    run_seconds = []  # the median of spec["repeats"] runs counts, as on pdserve's side
    for _ in range(spec.get("repeats", 1)):
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        run_seconds.append(time.perf_counter() - t0)
    mixed_s = statistics.median(run_seconds)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    single_prompt, num_new = spec["single_prompt"], spec["single_stream_tokens"]
    single_params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    llm.generate({"prompt_token_ids": single_prompt}, SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    t0 = time.perf_counter()
    single = llm.generate({"prompt_token_ids": single_prompt}, single_params, use_tqdm=False)
    single_s = time.perf_counter() - t0
    # Time to first token of one long prompt computed in full (prefix caching is off), the
    # best of 3, as pdserve's side times it.
    cold_ttft_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": spec["ttft_prompt"]}, SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
        cold_ttft_s.append(time.perf_counter() - t0)
    result = {"mixed_seconds": mixed_s, "mixed_run_seconds": run_seconds, "cold_ttft_s": min(cold_ttft_s),
              "num_output_tokens": num_tokens, "output_tokens_per_s": num_tokens / mixed_s,
              "single_stream_tokens_per_s": num_new / single_s,
              "single_stream_token_ids": list(single[0].outputs[0].token_ids),
              # after the runs, the engine core (a child process) still up: as pdserve measures its own
              "memory": tree_memory(),
              "vllm_version": __import__("vllm").__version__}
    with open(spec["out_path"], "w") as f:  # vLLM logs to stdout: the result goes to a file
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM starts its engine core with spawn, which re-imports main
    sys.exit(main())
