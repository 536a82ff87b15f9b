"""`pdserve bench sampling`: random sampling's cost, native ops against their torch forms.

    pdserve bench sampling --quantization gguf,none --num-seqs 1,8 --json docs/bench/sampling.json

One engine per quantization (the bundled model, bf16 for what it leaves dense, compiled).
For each sampling case (temperature; with top_p, top_k, min_p; with logprobs; penalties;
--case picks some) and batch size the same chat requests (max_tokens, ignore_eos, seeded)
decode in three arms, in turns (--repeats rounds, each round in the other order from the last, so the host's
drift lands on all alike): the rows sampled, logprobs included, inside the native decode
loop's region ("in loop", the default), by the sampler's native ops from the logits the
loop's head left ("after loop", Sampler.samples_in_loop off), and by the torch forms that
PDSERVE_CPU_ARGMAX=0 gives ("torch"). Reported: output
tokens/s (median round) and the median paired ratios in loop / after loop and after loop /
torch. Then the sampler alone, on logits the bundled model produced in those runs: ms per
call, native ops against torch forms.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench.scheduler_steps import PROMPTS, int_list, quantization_list

CASES = {
    "temperature 0.8": {"temperature": 0.8},
    "temperature 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "temperature 0.8, top_k 50": {"temperature": 0.8, "top_k": 50},
    "temperature 0.8, min_p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "temperature 1.0, top_k 50, top_p 0.9": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
    "temperature 1.0, logprobs 1": {"temperature": 1.0, "logprobs": 1},  # as RL rollouts ask
    "greedy, logprobs 5": {"temperature": 0.0, "logprobs": 5},
    "temperature 0.8, repetition 1.1, frequency 0.3": {"temperature": 0.8, "repetition_penalty": 1.1,
                                                        "frequency_penalty": 0.3},
}
ARMS = ("native", "torch")  # the sampler alone
DECODE_ARMS = ("in loop", "after loop", "torch")


def use_native(native: bool) -> None:
    """Switch the sampler between its native ops and their torch forms in this process (the
    ops stay loaded; the entry points ask native_argmax_available, which reads the switch)."""
    from kernels.cpu_sampling import native_argmax_available
    os.environ["PDSERVE_CPU_ARGMAX"] = "1" if native else "0"
    native_argmax_available.cache_clear()
    if native and not native_argmax_available():
        raise SystemExit("the native sampling ops do not build here (no C++ compiler?): nothing to compare")


def use_decode_arm(llm, arm: str) -> None:
    """Switch the engine's sampling to one of DECODE_ARMS."""
    use_native(arm != "torch")
    llm.engine.executor.runner.sampler.samples_in_loop = arm == "in loop"


def decode_rates(llm, case: dict, num_seqs: int, max_tokens: int, repeats: int) -> dict:
    """Output tokens/s of each of DECODE_ARMS (median round) and the median paired speed-ups
    in loop over after loop, after loop over torch."""
    from common import SamplingParams
    conversations = [[{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} ({i})"}] for i in range(num_seqs)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0, **case)
    seconds: dict[str, list[float]] = {arm: [] for arm in DECODE_ARMS}
    try:
        for round_index in range(repeats + 1):  # round 0 warms up every arm
            for arm in (DECODE_ARMS if round_index % 2 == 0 else DECODE_ARMS[::-1]):
                use_decode_arm(llm, arm)
                started = time.perf_counter()
                llm.chat(conversations, params, use_tqdm=False)
                if round_index > 0:
                    seconds[arm].append(time.perf_counter() - started)
    finally:
        use_decode_arm(llm, "in loop")
    num_tokens = num_seqs * max_tokens

    def speed_up(faster: str, slower: str) -> float:
        return round(statistics.median(s / f for f, s in zip(seconds[faster], seconds[slower])), 3)

    return {"tokens_per_s": {arm: round(num_tokens / statistics.median(s), 1) for arm, s in seconds.items()},
            "in_loop_over_after_loop": speed_up("in loop", "after loop"),
            "after_loop_over_torch": speed_up("after loop", "torch")}


def capture_logits(llm, num_rows: int):
    """[num_rows, vocab] fp32 logits of the bundled model's decode steps (chat prompts,
    temperature 0.8), caught on their way into the sampler."""
    import torch

    from common import SamplingParams
    runner = llm.engine.executor.runner
    sampler = runner.sampler
    rows = []

    class Recording:
        def __call__(self, logits, *args, **kwargs):
            rows.append(logits.float().clone())
            return sampler(logits, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(sampler, name)

    runner.sampler = Recording()
    try:
        conversations = [[{"role": "user", "content": f"{p} ({i})"}] for i, p in enumerate(PROMPTS)]
        llm.chat(conversations, SamplingParams(temperature=0.8, max_tokens=max(2, num_rows // len(PROMPTS) + 2),
                                               ignore_eos=True, seed=0), use_tqdm=False)
    finally:
        runner.sampler = sampler
    return torch.cat(rows)[-num_rows:]


def sampler_ms(logits, case: dict, num_seqs: int, repeats: int) -> dict:
    """ms per Sampler call over rows of real logits, each arm's best of `repeats` passes."""
    from common.engine.outputs import ScheduledRequest
    from common.engine.sampler import Sampler
    from common.engine.sampling_params import SamplingParams
    requests = [ScheduledRequest(f"r{i}", [0], 1, [0], True, SamplingParams(max_tokens=16, seed=i, **case), [0], [1])
                for i in range(num_seqs)]
    batches = [logits[i:i + num_seqs] for i in range(0, logits.shape[0] - num_seqs + 1, num_seqs)]
    best = {arm: float("inf") for arm in ARMS}
    try:
        for round_index in range(repeats):
            for arm in (ARMS if round_index % 2 == 0 else ARMS[::-1]):
                use_native(arm == "native")
                sampler = Sampler(eos_token_ids=[0])
                started = time.perf_counter()
                for batch in batches:
                    sampler(batch, requests)
                best[arm] = min(best[arm], (time.perf_counter() - started) / len(batches))
    finally:
        use_native(True)
    return {arm: round(1e3 * seconds, 3) for arm, seconds in best.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench sampling", description=__doc__.split("\n")[0])
    parser.add_argument("--quantization", type=quantization_list, default=["gguf", "none"],
                        help="comma-separated from none, gguf, int8 (one engine each)")
    parser.add_argument("--num-seqs", type=int_list, default=[1, 8], help="batch sizes, comma-separated")
    parser.add_argument("--case", action="append", choices=list(CASES), default=None,
                        help="a sampling case to run (repeat for more; default: every one)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args(argv)

    import torch

    from bench.profile import cpu_model_name
    from common import LLM
    result = {"cpu": cpu_model_name(), "torch_threads": None, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "decode": [], "sampler_ms": []}
    cases = {name: CASES[name] for name in args.case or CASES}
    logits = None
    for quantization in args.quantization:
        llm = LLM(quantization=None if quantization == "none" else quantization, dtype="bfloat16",
                  kv_cache_memory="512MiB", num_threads=args.num_threads)
        result["torch_threads"] = torch.get_num_threads()
        for name, case in cases.items():
            for num_seqs in args.num_seqs:
                run = {"quantization": quantization, "case": name, "num_seqs": num_seqs,
                       **decode_rates(llm, case, num_seqs, args.max_tokens, args.repeats)}
                result["decode"].append(run)
                print(json.dumps(run), flush=True)
        if logits is None:
            logits = capture_logits(llm, 64)
        llm.engine.shutdown()
    for name, case in cases.items():
        for num_seqs in args.num_seqs:
            run = {"case": name, "num_seqs": num_seqs, **sampler_ms(logits, case, num_seqs, args.repeats)}
            result["sampler_ms"].append(run)
            print(json.dumps(run), flush=True)
    print(f"CPU: {result['cpu']} ({result['torch_threads']} torch threads)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
