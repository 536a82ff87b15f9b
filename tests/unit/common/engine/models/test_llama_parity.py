"""Greedy and teacher-forced parity with transformers on tiny random Llama / Qwen2 models."""
from __future__ import annotations

import random

import pytest
import torch

from common import LLM, SamplingParams
from tests.parity import hf_greedy, hf_teacher_forced_logprobs

CONFIGS = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied-rope-llama3": ("llama", dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama-rope-linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2-qkv-bias": ("qwen2", dict(tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_model_matches_transformers(tiny_model_factory, name):
    from transformers import AutoModelForCausalLM
    arch, overrides = CONFIGS[name]
    model_dir = tiny_model_factory(name, arch, **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=48, block_size=8)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 17, 70, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        ours = output.outputs[0].token_ids
        assert ours == hf_greedy(hf_model, prompt, 12)
        ours_lp = torch.tensor([lp.token_logprob for lp in output.outputs[0].logprobs])
        torch.testing.assert_close(ours_lp, hf_teacher_forced_logprobs(hf_model, prompt, ours),
                                   atol=1e-3, rtol=0)
    assert llm.engine.kv_cache_manager.num_free_blocks == 64


def test_prompt_logprobs_match_transformers_across_chunks_and_skip_the_prefix_cache(tiny_model_factory):
    from transformers import AutoModelForCausalLM
    model_dir = tiny_model_factory("llama-tied", "llama", tie_word_embeddings=True)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=48, block_size=8)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (70, 5, 1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], greedy)[0]
    assert first.prompt_logprobs is None
    # The same prompt again: its first 64 tokens are cached, but prompt logprobs need them all.
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy.clone(prompt_logprobs=3))
    for prompt, output in zip(prompts, outputs):
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        if len(prompt) == 1:
            continue
        ours = torch.tensor([lp.token_logprob for lp in output.prompt_logprobs[1:]])
        torch.testing.assert_close(ours, hf_teacher_forced_logprobs(hf_model, prompt[:1], prompt[1:]),
                                   atol=1e-3, rtol=0)
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)  # [P-1, vocab]
        top_values = torch.tensor([lp.top_logprobs for lp in output.prompt_logprobs[1:]])
        torch.testing.assert_close(top_values, reference.topk(3, dim=-1).values, atol=1e-3, rtol=0)
        assert all(len(lp.top_token_ids) == 3 for lp in output.prompt_logprobs[1:])
        # each prompt token's rank among all tokens: 1 + those more likely (within fp32 noise)
        targets = reference.gather(1, torch.tensor(prompt[1:])[:, None])  # [P-1, 1]
        expected_ranks = ((reference > targets + 1e-4).sum(-1) + 1).tolist()
        ranks = [lp.token_rank for lp in output.prompt_logprobs[1:]]
        assert all(low <= r <= high for r, low, high in zip(
            ranks, expected_ranks, ((reference > targets - 1e-4).sum(-1) + 1).tolist())), (ranks, expected_ranks)
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 2)
    assert outputs[0].num_cached_tokens == 0 and first.num_cached_tokens == 0
    again = llm.generate([{"prompt_token_ids": prompts[0]}], greedy)[0]
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.kv_cache_manager.num_free_blocks == 64
