"""Runs inside vLLM's own venv (not pdserve's): `pdserve bench lora --peer vllm`'s arms through
vllm.LLM with enable_lora. It imports nothing from pdserve. The spec is one JSON object on
stdin (the model, the prompts' token ids, the adapters' paths, the sampling); the result, one
JSON object, goes to the file the spec names (vLLM logs to stdout)."""
from __future__ import annotations

import json
import statistics
import sys
import time


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(spec["model_dir"], dtype=spec["dtype"], enable_lora=True, max_loras=2, max_lora_rank=spec["rank"],
              max_model_len=spec["max_model_len"], enable_prefix_caching=False, seed=0)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    single = SamplingParams(max_tokens=spec["single_stream_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    adapters = [LoRARequest(name, i, path) for i, (name, path) in enumerate(spec["adapters"], start=1)]

    def timed(batch, sampling, lora) -> float:
        started = time.perf_counter()
        outputs = llm.generate(batch, sampling, lora_request=lora, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)

    arms = {"lora-off": None, "lora-one": adapters[0], "lora-two": [adapters[i % 2] for i in range(len(prompts))]}
    results = {}
    for name, lora in arms.items():
        warm = lora[:4] if isinstance(lora, list) else lora
        timed(prompts[:4], params, warm)
        passes = [timed(prompts, params, lora) for _ in range(spec["repeats"])]
        one = lora[0] if isinstance(lora, list) else lora
        stream = timed([{"prompt_token_ids": spec["prompts"][0][:16]}], single, one)
        results[name] = {"output_tok_s": statistics.median(passes), "passes": passes, "single_stream_tok_s": stream}
        print(f"vLLM {name}: {results[name]['output_tok_s']:.1f} tok/s, one stream {stream:.1f}", flush=True)
    import vllm
    with open(spec["result_path"], "w") as f:
        json.dump({"vllm_version": vllm.__version__, "arms": results}, f)


if __name__ == "__main__":
    main()
