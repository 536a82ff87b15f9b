"""`pdserve bench spec`: speculative decoding on the bundled model, per proposer and workload.

Three workloads: copy-heavy (repeat or lightly edit a given passage: n-gram lookups
find most of the output in the prompt), open-ended chat, and random-token prompts
(nothing to look up: the off-switch must keep the cost near zero). Each runs as one
stream (requests one after another) and as one batch (all at once), through the
offline engine with speculation off and with each proposer; greedy, so every arm must
give the same tokens (checked). One stream interleaves the arms request by request,
so drift on a shared machine hits all of them alike.

Reports output tokens/s, the ratio to no speculation, the acceptance rate and the
mean acceptance length (1 + accepted / drafts); and a draft model equal to the
target, whose acceptance must be exactly 1.0 with mean length k + 1.
"""
from __future__ import annotations

import argparse
import json
import random
import time

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and wrote "
    "the names of passing ships in a leather logbook. In winter the storms came early, and the keeper "
    "counted the waves that broke against the rocks below the tower.",
    "To reset the router, hold the small button on the back for ten seconds until the lights blink. Wait "
    "two minutes, then connect to the network named on the label and open the setup page in a browser.",
    "Our quarterly meeting moves to Thursday at three in the afternoon. Please bring the budget figures, "
    "the hiring plan for the new office, and any questions about the travel policy that changed last month.",
    "Bake the bread at two hundred degrees for forty minutes. Let it cool on a rack for an hour before "
    "slicing, or the crumb will be gummy. Store it wrapped in a cloth, never in the refrigerator.",
]
COPY_ASKS = ["Repeat the following text exactly:\n\n{}", "Fix any typos in this text and return it in full:\n\n{}"]
CHAT_QUESTIONS = ["Write a short poem about autumn.", "What are three tips for learning a new language?",
                  "Explain what a rainbow is to a child.", "Suggest a name for a bakery and say why.",
                  "Describe your ideal weekend.", "Why do cats purr?", "Give me a recipe idea with eggs.",
                  "What is the difference between weather and climate?"]
WORKLOADS = ("copy", "chat", "random")


def workload_prompts(name: str, num_prompts: int, vocab_size: int) -> list:
    if name == "copy":
        return [[{"role": "user", "content": COPY_ASKS[i % len(COPY_ASKS)].format(PASSAGES[i % len(PASSAGES)])}]
                for i in range(num_prompts)]
    if name == "chat":
        return [[{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}] for i in range(num_prompts)]
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(64)]} for _ in range(num_prompts)]


def arm_configs(k: int, num_early_exit_layers: int) -> dict[str, dict | None]:
    return {"off": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": k},
            "early_exit": {"method": "early_exit", "num_speculative_tokens": k,
                           "num_early_exit_layers": num_early_exit_layers}}


def spec_stats(llm) -> dict:
    stats = llm.engine.stats()
    return {key: stats.get(key, 0) for key in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")}


def stats_delta(before: dict, after: dict) -> dict:
    delta = {key: after[key] - before[key] for key in after}
    drafts, tokens, accepted = (delta["spec_num_drafts"], delta["spec_num_draft_tokens"],
                                delta["spec_num_accepted_tokens"])
    return {"acceptance_rate": accepted / tokens if tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None, "num_draft_tokens": tokens}


class Arm:
    def __init__(self, name: str, llm, params):
        self.name, self.llm, self.params = name, llm, params
        self.seconds = 0.0
        self.token_ids: list[list[int]] = []

    def run(self, prompts: list) -> None:
        chat = isinstance(prompts[0], list)
        started = time.perf_counter()
        outputs = (self.llm.chat(prompts, self.params, use_tqdm=False) if chat
                   else self.llm.generate(prompts, self.params, use_tqdm=False))
        self.seconds += time.perf_counter() - started
        self.token_ids += [o.outputs[0].token_ids for o in outputs]


def measure(arms_llms: dict, prompts: list, params, batched: bool) -> dict:
    arms = {name: Arm(name, llm, params) for name, llm in arms_llms.items()}
    before = {name: spec_stats(llm) for name, llm in arms_llms.items()}
    batches = [prompts] if batched else [[p] for p in prompts]
    for batch in batches:  # interleaved: each batch through every arm before the next
        for arm in arms.values():
            arm.run(batch)
    base = arms["off"]
    num_tokens = sum(len(t) for t in base.token_ids)
    result = {}
    for name, arm in arms.items():
        tokens_per_s = sum(len(t) for t in arm.token_ids) / arm.seconds
        result[name] = {"output_tokens_per_s": round(tokens_per_s, 2),
                        "speedup": round(tokens_per_s / (num_tokens / base.seconds), 3),
                        "same_tokens_as_off": arm.token_ids == base.token_ids,
                        **stats_delta(before[name], spec_stats(arm.llm))}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench spec", description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8, help="requests per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--num-early-exit-layers", type=int, default=8)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (auto: bf16 where the CPU has it)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)

    from bench.profile import cpu_model_name
    from common import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engine = dict(kv_cache_memory="256MiB", dtype=args.dtype)
    arms_llms = {name: LLM(speculative_config=config, **engine)
                 for name, config in arm_configs(args.num_speculative_tokens, args.num_early_exit_layers).items()}
    vocab_size = arms_llms["off"].engine.model_config.vocab_size
    warm_up = workload_prompts("chat", 2, vocab_size)
    for llm in arms_llms.values():
        llm.chat(warm_up, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)

    figures = {"cpu": cpu_model_name(), "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
               "num_speculative_tokens": args.num_speculative_tokens, "dtype": args.dtype, "workloads": {}}
    for workload in args.workloads.split(","):
        prompts = workload_prompts(workload, args.num_prompts, vocab_size)
        figures["workloads"][workload] = {mode: measure(arms_llms, prompts, params, batched=mode == "batched")
                                          for mode in ("single_stream", "batched")}
        print(json.dumps({workload: figures["workloads"][workload]}, indent=2), flush=True)
    for llm in arms_llms.values():
        llm.engine.shutdown()

    # A draft model equal to the target: every draft must be accepted.
    k = args.num_speculative_tokens
    max_tokens = 1 + 6 * (k + 1)  # the prefill samples one token, then six verifications of k drafts
    target_dir = str(arms_llms["off"].engine.model_dir)
    llm = LLM(speculative_config={"method": "draft_model", "num_speculative_tokens": k, "draft_model": target_dir},
              **engine)
    llm.chat(workload_prompts("chat", 4, vocab_size), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                     ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    figures["draft_equals_target"] = {"acceptance_rate": stats["spec_acceptance_rate"],
                                      "mean_acceptance_length": stats["spec_mean_acceptance_length"],
                                      "expected_mean_acceptance_length": k + 1}
    llm.engine.shutdown()
    print(json.dumps({"draft_equals_target": figures["draft_equals_target"]}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0

