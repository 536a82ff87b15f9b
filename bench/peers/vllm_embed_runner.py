"""Runs inside vLLM's own venv (not pdserve's): embeddings through vLLM's pooling runner
(`LLM(..., runner="pooling", convert="embed")`, how vLLM serves a generative checkpoint as an
embedding model), one measurement per request, so pdserve's runs and vLLM's can alternate.

`pdserve bench embed --peer vllm` starts this file with that venv's python; the protocol is
vllm_offline_runner's (the spec on stdin's first line: the model, the prompts' token ids;
then `{"op": "embed", "num_vectors": k}` and `"quit"`), answered on the spec's pipe.
"""
from __future__ import annotations

import sys
import time

from vllm_offline_runner import serve  # beside this file (this script's directory leads sys.path)


class Runner:
    def __init__(self, spec: dict):
        from vllm import LLM
        from vllm.config import PoolerConfig

        self.llm = LLM(spec["model_dir"], runner="pooling", convert="embed", dtype=spec["dtype"], seed=0,
                       max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
                       max_num_batched_tokens=spec["max_num_batched_tokens"], enable_prefix_caching=False,
                       pooler_config=PoolerConfig(pooling_type=spec.get("pooling_type", "LAST")))
        self.prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        self.llm.embed(self.prompts[:2], use_tqdm=False)  # warm-up

    def embed(self, num_vectors: int = 0) -> dict:
        """One timed pass over every prompt, and the first num_vectors embeddings."""
        t0 = time.perf_counter()
        outputs = self.llm.embed(self.prompts, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "vectors": [list(o.outputs.embedding) for o in outputs[:num_vectors]]}


def main() -> int:
    def make_ops(spec: dict) -> dict:
        return {"embed": Runner(spec).embed}
    return serve(make_ops, {"embed": {"num_vectors"}})


if __name__ == "__main__":  # vLLM starts its engine core with spawn, which re-imports main
    sys.exit(main())
