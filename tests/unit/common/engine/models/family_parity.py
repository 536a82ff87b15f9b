"""One parity check for every model family: our engine against transformers on a tiny random model.

fp32, greedy, 32 new tokens, each prompt set run unchunked, chunked (16-token steps)
and again after its prefix is cached. Tokens must match exactly; the chosen tokens'
logprobs, teacher-forced through transformers, within LOGPROB_ATOL.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from common import LLM, SamplingParams
from tests.conftest import TOKENIZER_FILES
from tests.parity import hf_greedy, hf_teacher_forced_logprobs

LOGPROB_ATOL = 1e-3
NUM_NEW_TOKENS = 32
BLOCK_SIZE = 8
# The bundled tokenizer's vocabulary (copied in so text prompts work); init 0.5 keeps
# random models from repeating one token.
TINY_SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.5)


def save_tiny_model(out_dir: Path, config_cls, model_cls, tokenizer_dir: Path, **overrides) -> Path:
    config = config_cls(**{**TINY_SHAPE, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        # Norm weights start as all ones (or zeros, Gemma): random ones make a norm
        # applied with the wrong offset, or to the wrong tensor, show.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape) * 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def parity_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, TINY_SHAPE["vocab_size"]) for _ in range(n)] for n in (5, 17, 70, 1)]



def assert_matches_transformers(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = parity_prompts()
    expected_tokens = [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, logprobs=1)
    for max_num_batched_tokens in (2048, 16):  # unchunked, then 16-token prefill chunks
        llm = LLM(model=str(model_dir), num_kv_blocks=128, block_size=BLOCK_SIZE,
                  max_num_batched_tokens=max_num_batched_tokens)
        # The second pass finds every full block of each prompt in the prefix cache.
        for pass_idx in range(2):
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            for prompt, expected, output in zip(prompts, expected_tokens, outputs):
                where = f"chunk budget {max_num_batched_tokens}, pass {pass_idx}, prompt len {len(prompt)}"
                if pass_idx == 1:
                    assert output.num_cached_tokens >= (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE, where
                ours = output.outputs[0].token_ids
                assert ours == expected, where
                ours_logprobs = torch.tensor([lp.token_logprob for lp in output.outputs[0].logprobs])
                torch.testing.assert_close(ours_logprobs, hf_teacher_forced_logprobs(hf_model, prompt, ours),
                                           atol=LOGPROB_ATOL, rtol=0, msg=lambda m: f"{where}: {m}")
