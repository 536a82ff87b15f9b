"""Runs inside vLLM's own venv (not pdserve's): the offline workload through vllm.LLM,
one measurement per request, so pdserve's runs and vLLM's can alternate.

`pdserve bench offline --peer vllm` starts this file with that venv's python. It imports
nothing from pdserve, since pdserve is not installed there. The first line on stdin is
the spec (the model, the prompts' token ids and max_tokens, the pipe to answer on); the
runner builds its engine, answers {"ready": ...}, then serves one JSON request per line
(`{"op": "mixed"}`, `"single_stream"`, `"cold_ttft"` with an optional `"repeats"`, `"memory"`,
`"quit"`) with one JSON
line each on that pipe. vLLM logs to stdout, so answers never go there.
"""
from __future__ import annotations

import json
import os
import sys
import time

from proc_memory import tree_memory  # beside this file (this script's directory leads sys.path)


class Runner:
    def __init__(self, spec: dict):
        from vllm import LLM, SamplingParams

        self.spec = spec
        self.sampling_params = SamplingParams
        self.llm = LLM(spec["model_dir"], dtype=spec["dtype"], seed=spec["seed"],
                       max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
                       max_num_batched_tokens=spec["max_num_batched_tokens"], enable_prefix_caching=False,
                       kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
                       speculative_config=spec.get("speculative_config"))
        workload = spec["workload"]  # [[prompt_token_ids, max_tokens], ...]
        self.prompts = [{"prompt_token_ids": p} for p, _ in workload]
        # The mixed workload's sampling as pdserve's side takes it (bench.offline.run_ours; no
        # per-request seeds: this build's engine stops on one, "CPU Generator does not use offset").
        temperature, logprobs = spec.get("temperature", 0.0), spec.get("logprobs")
        self.params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, logprobs=logprobs)
                       for _, m in workload]
        self.llm.generate(self.prompts[:2], self.params[:2], use_tqdm=False)  # warm-up

    def mixed(self) -> dict:
        """One timed run of the whole workload."""
        t0 = time.perf_counter()
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}

    def single_stream(self) -> dict:
        """Decode tokens/s of one request alone, after a short warm-up request."""
        prompt, num_new = self.spec["single_prompt"], self.spec["single_stream_tokens"]
        params = self.sampling_params(temperature=0.0, max_tokens=num_new, ignore_eos=True)
        self.llm.generate({"prompt_token_ids": prompt}, self.sampling_params(temperature=0.0, max_tokens=4),
                          use_tqdm=False)
        t0 = time.perf_counter()
        output = self.llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return {"tokens_per_s": num_new / (time.perf_counter() - t0),
                "token_ids": list(output[0].outputs[0].token_ids)}

    def cold_ttft(self, repeats: int = 3) -> dict:
        """Time to first token of one long prompt computed in full (prefix caching is off),
        the best of `repeats`, as pdserve's side times it."""
        params = self.sampling_params(temperature=0.0, max_tokens=1)
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.llm.generate({"prompt_token_ids": self.spec["ttft_prompt"]}, params, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
        return {"seconds": min(seconds)}

    def memory(self) -> dict:
        # The engine core (a child process) is up: as pdserve measures its own.
        return tree_memory()


# What each op takes beside its name (the rest take nothing).
OP_PARAMS = {"cold_ttft": {"repeats"}}


def main() -> int:
    def make_ops(spec: dict) -> dict:
        runner = Runner(spec)
        return {"mixed": runner.mixed, "single_stream": runner.single_stream, "cold_ttft": runner.cold_ttft,
                "memory": runner.memory}
    return serve(make_ops, OP_PARAMS)


def serve(make_ops, op_params: dict[str, set[str]]) -> int:
    """The runners' protocol (the module doc): the spec from stdin's first line, make_ops(spec)
    -> {op name: method} (the engine built), then one answer per request line until "quit"."""
    spec = json.loads(sys.stdin.readline())
    with os.fdopen(spec["answer_fd"], "w", buffering=1) as answers:
        ops = make_ops(spec)
        answers.write(json.dumps({"ready": True, "vllm_version": __import__("vllm").__version__}) + "\n")
        for line in sys.stdin:
            message = json.loads(line)
            op = message.pop("op", None)
            if op == "quit":
                break
            if op not in ops:
                answer = {"error": f"unknown op {op!r}; known: {sorted(ops)}"}
            elif set(message) - op_params.get(op, set()):
                answer = {"error": f"{op} takes {sorted(op_params.get(op, set()))}, got {sorted(message)}"}
            else:
                answer = ops[op](**message)
            answers.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":  # vLLM starts its engine core with spawn, which re-imports main
    sys.exit(main())
