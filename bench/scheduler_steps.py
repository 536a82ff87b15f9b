"""`pdserve bench scheduler-steps`: decode tokens/s at each --num-scheduler-steps.

    pdserve bench scheduler-steps --quantization gguf --num-seqs 1,8 --steps 1,4,8,16

One engine per quantization (the bundled model, bf16 for what it leaves dense, compiled
unless --enforce-eager); for each batch size the same chat requests (max_tokens,
ignore_eos; greedy, or seeded draws at --temperature; each token's --logprobs where given;
--repetition-penalty, --frequency-penalty)
run at every steps value in turn, --repeats rounds, each round in the other
order from the last, so the host's drift from minute to minute lands on every value alike.
The prompts repeat, so after the warm-up their prefill is a prefix-cache hit and a
request's time is its decode steps. Reported per value: output tokens/s (the median
round), and against the first value the median over rounds of the paired difference,
in ms per decode step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PROMPTS = ["Write a short poem about autumn.", "Why do cats purr?", "Describe your ideal weekend.",
           "Give me a recipe idea with eggs.", "What are three tips for learning a new language?",
           "Explain what a rainbow is to a child.", "Suggest a name for a bakery and say why.",
           "What is the difference between weather and climate?"]


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers >= 1; got {text!r}")
    return values


def quantization_list(text: str) -> list[str]:
    """--quantization: comma-separated from none, gguf, int8 (one engine each)."""
    values = [v for v in text.split(",") if v]
    if not values or not set(values) <= {"none", "gguf", "int8"}:
        raise argparse.ArgumentTypeError(f"takes none, gguf and int8, comma-separated; got {text!r}")
    return values


def measure(llm, num_seqs: int, steps: list[int], max_tokens: int, repeats: int, temperature: float = 0.0,
            logprobs: int | None = None, repetition_penalty: float = 1.0, frequency_penalty: float = 0.0) -> dict:
    """One batch size through every steps value: {"tokens_per_s": {steps: ...},
    "paired_ms_per_step": {steps: ...}} (the second against steps[0])."""
    from common import SamplingParams
    conversations = [[{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} ({i})"}] for i in range(num_seqs)]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0, logprobs=logprobs,
                            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty)
    scheduler = llm.engine.scheduler
    llm.chat(conversations, params, use_tqdm=False)  # warm-up, and the prompts into the prefix cache
    seconds: dict[int, list[float]] = {k: [] for k in steps}
    for round_index in range(repeats):
        for num_steps in (steps if round_index % 2 == 0 else steps[::-1]):
            scheduler.num_scheduler_steps = num_steps
            started = time.perf_counter()
            llm.chat(conversations, params, use_tqdm=False)
            seconds[num_steps].append(time.perf_counter() - started)
    num_tokens = num_seqs * max_tokens
    base = steps[0]
    return {
        "tokens_per_s": {str(k): round(num_tokens / statistics.median(s), 1) for k, s in seconds.items()},
        "paired_ms_per_step": {str(k): round(1e3 * statistics.median(
            [a - b for a, b in zip(seconds[base], s)]) / max_tokens, 3) for k, s in seconds.items() if k != base},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench scheduler-steps", description=__doc__.split("\n")[0])
    parser.add_argument("--quantization", type=quantization_list, default=["gguf"],
                        help="comma-separated from none, gguf, int8 (one engine each)")
    parser.add_argument("--num-seqs", type=int_list, default=[1], help="batch sizes, comma-separated")
    parser.add_argument("--steps", type=int_list, default=[1, 4, 8, 16],
                        help="--num-scheduler-steps values, comma-separated; the first is the baseline")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded draws")
    parser.add_argument("--logprobs", type=int, default=None, help="each token's logprobs and this many top ones")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args(argv)

    import torch

    from bench.profile import cpu_model_name
    from common import LLM
    result = {"cpu": cpu_model_name(), "torch_threads": None, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "logprobs": args.logprobs,
              "repetition_penalty": args.repetition_penalty, "frequency_penalty": args.frequency_penalty,
              "repeats": args.repeats, "compiled": not args.enforce_eager, "runs": []}
    for quantization in args.quantization:
        llm = LLM(quantization=None if quantization == "none" else quantization, dtype="bfloat16",
                  kv_cache_memory="512MiB", enforce_eager=args.enforce_eager, num_threads=args.num_threads)
        result["torch_threads"] = torch.get_num_threads()
        for num_seqs in args.num_seqs:
            run = {"quantization": quantization, "num_seqs": num_seqs,
                   **measure(llm, num_seqs, args.steps, args.max_tokens, args.repeats, args.temperature,
                             args.logprobs, args.repetition_penalty, args.frequency_penalty)}
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
        llm.engine.shutdown()
    print(f"CPU: {result['cpu']} ({result['torch_threads']} torch threads)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
