"""Greedy parity of our engine with transformers on the bundled SmolLM2-135M-Instruct."""
from __future__ import annotations

import pytest
import torch

from common import LLM, SamplingParams
from tests.parity import hf_greedy, hf_teacher_forced

# The offline engine in this process only: the parallel part runs it, its tests on one worker
# (they share the module's engine).
pytestmark = [pytest.mark.slow, pytest.mark.in_process]

NUM_NEW_TOKENS = 32
TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5, 6,",
    "Translate to French: Good morning, how are you today?",
    "Les plus beaux paysages d'Europe sont",
]
LONG_PROMPT = " ".join(
    f"Fact {i}: the {color} box on shelf {i} holds {i * 7 % 13} marbles and a note about {topic}."
    for i, (color, topic) in enumerate(
        [("red", "tides"), ("blue", "volcanoes"), ("green", "bees"), ("amber", "trains")] * 6)
) + " Summarize the facts above:"


@pytest.fixture(scope="module")
def llm():
    # A small token budget so the long prompt is prefilled in several chunks
    # while the short ones are already decoding.
    return LLM(num_kv_blocks=256, max_num_batched_tokens=128, max_num_seqs=16)


@pytest.fixture(scope="module")
def hf_model(bundled_model_dir, llm):
    from transformers import AutoModelForCausalLM
    device = llm.engine.executor.runner.device  # the same device as ours: the GPU where there is one
    return AutoModelForCausalLM.from_pretrained(bundled_model_dir, dtype=torch.float32).to(device).eval()


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}])
    all_prompts = [tok.encode(p) for p in TEXT_PROMPTS] + [tok.encode(LONG_PROMPT), chat]
    assert len(all_prompts[-2]) > 300
    return all_prompts


def test_greedy_tokens_and_logprobs_match_transformers(llm, hf_model, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outputs) == len(prompts) >= 8
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        ours = output.outputs[0].token_ids
        # Shorter only by stopping at EOS, which is then our last token and HF's last pick.
        assert len(ours) == NUM_NEW_TOKENS or (output.outputs[0].finish_reason == "stop"
                                              and ours[-1] in llm.tokenizer.eos_token_ids)
        # HF's greedy pick after each of our prefixes: equal to ours at every position is
        # HF's greedy generation giving our tokens (one forward per prompt rather than 32).
        ref_logprobs, hf_picks = hf_teacher_forced(hf_model, prompt, ours)
        assert ours == hf_picks, f"prompt of {len(prompt)} tokens"
        if i == 0:  # and the generate() loop itself, once
            assert ours == hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)
        our_logprobs = torch.tensor([lp.token_logprob for lp in output.outputs[0].logprobs])
        torch.testing.assert_close(our_logprobs, ref_logprobs, atol=1e-3, rtol=0)
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.config.cache.num_blocks


def test_text_prompt_and_chat_api(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    by_text = llm.generate(TEXT_PROMPTS[0], params)[0]
    by_ids = llm.generate({"prompt_token_ids": llm.tokenizer.encode(TEXT_PROMPTS[0])}, params)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == llm.tokenizer.decode(by_text.outputs[0].token_ids)
    assert by_text.outputs[0].finish_reason in ("stop", "length")
    chat = llm.chat([{"role": "user", "content": "Say hello."}], params)[0]
    assert chat.prompt_token_ids == llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    started = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]
    continued = llm.chat(started, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert llm.tokenizer.decode(continued.prompt_token_ids, skip_special_tokens=False).endswith(
        "The capital of France is")
    assert "Paris" in continued.outputs[0].text  # the model finishes the sentence it was given
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(started, params, continue_final_message=True)
    own = llm.chat(started[:1], params, chat_template="Q: {{ messages[0]['content'] }}\nA:")[0]
    assert own.prompt_token_ids == llm.tokenizer.encode("Q: What is the capital of France?\nA:",
                                                        add_special_tokens=False)
    long_ids = llm.tokenizer.encode(TEXT_PROMPTS[0])
    truncated = llm.generate({"prompt_token_ids": long_ids}, params.clone(truncate_prompt_tokens=3))[0]
    assert truncated.prompt_token_ids == long_ids[-3:]
    paris = llm.generate("The capital of France is", params)[0].outputs[0].text
    assert "Paris" in paris
    # a stop token ends the output: in token_ids, its text only with include_stop_str_in_output (vLLM's)
    free = llm.generate("The capital of France is", params)[0].outputs[0]
    stop_token = free.token_ids[2]
    for stop_strings in ([], ["never written"]):  # decoded at the end, or streamed to watch for a string
        stopped = llm.generate("The capital of France is", params.clone(stop_token_ids=[stop_token],
                                                                        stop=stop_strings))[0].outputs[0]
        assert stopped.token_ids == free.token_ids[:free.token_ids.index(stop_token) + 1]
        assert stopped.text == llm.tokenizer.decode(stopped.token_ids[:-1])
        kept = llm.generate("The capital of France is", params.clone(stop_token_ids=[stop_token], stop=stop_strings,
                                                                     include_stop_str_in_output=True))[0].outputs[0]
        assert kept.text == llm.tokenizer.decode(stopped.token_ids)
    shown = llm.chat([{"role": "user", "content": "Say hello."}],
                     params.clone(max_tokens=60, skip_special_tokens=False))[0].outputs[0]
    assert shown.finish_reason == "stop" and "<|im_end|>" not in shown.text
    banned = llm.generate("The capital of France is", params.clone(bad_words=["Paris"]))[0].outputs[0].text
    assert "Paris" not in banned, banned
