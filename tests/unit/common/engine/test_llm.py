"""The offline LLM's prompt forms: {'prompt': text}, {'prompt_token_ids': ids}, and a
prompt's cache_salt (vLLM's), which keeps its prefix-cache blocks to prompts of the same
salt, for generation and embeddings alike."""
from __future__ import annotations

import pytest

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from kernels.huge_pages import whole_small_pages
from tests.support.memory_maps import resident_bytes

PROMPT = list(range(5, 45))  # 40 tokens: 5 full blocks of 8


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    engine = LLM(model=str(tiny_model_factory("tiny-llama", "llama")), num_kv_blocks=64, block_size=8,
                 enforce_eager=True)
    yield engine
    engine.engine.shutdown()


def cached(llm: LLM, prompt: dict) -> int:
    return llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))[0].num_cached_tokens


def test_a_salted_prompt_shares_cached_blocks_only_with_its_own_salt(llm):
    llm.reset_prefix_cache()
    first = llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"},
                         SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert first.num_cached_tokens == 0
    assert cached(llm, {"prompt_token_ids": PROMPT}) == 0  # unsalted: not tenant-a's blocks
    assert cached(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-b"}) == 0
    assert cached(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}) == 32
    again = llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"},
                         SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids  # the salt changes no output
    assert llm.embed({"prompt_token_ids": PROMPT, "cache_salt": "tenant-c"})[0].num_cached_tokens == 0
    assert llm.embed({"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"})[0].num_cached_tokens == 32


def test_a_bad_salt_is_refused_before_anything_runs(llm):
    for salt, match in (("", "non-empty"), ("a/b", "must not contain"), ("x" * 129, "at most 128"), (7, "string")):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT, "cache_salt": salt}])
    assert not llm.engine.has_unfinished_requests()


def test_a_text_prompt_dict_is_its_text(llm):
    text = "The capital of France"
    by_dict = llm.generate({"prompt": text}, SamplingParams(max_tokens=3, temperature=0.0))[0]
    by_text = llm.generate(text, SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert by_dict.prompt == text and by_dict.prompt_token_ids == by_text.prompt_token_ids
    assert by_dict.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_generate_without_sampling_params_samples_as_the_models_generation_config(llm, tiny_model_factory, tmp_path):
    assert llm.get_default_sampling_params() == SamplingParams()  # the tiny model has no generation config
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "top_k": 0, "max_new_tokens": 5}')
    configured = LLM(model=str(tiny_model_factory("tiny-llama", "llama")), num_kv_blocks=64, block_size=8,
                     enforce_eager=True, generation_config=str(tmp_path))
    try:
        assert configured.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=-1, max_tokens=5)
        prompt = {"prompt_token_ids": PROMPT}
        greedy = configured.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0]
        assert configured.generate(prompt)[0].outputs[0].token_ids == greedy.token_ids and len(greedy.token_ids) == 5
    finally:
        configured.engine.shutdown()
    with pytest.raises(ValueError, match=r"--override-generation-config: unknown field 'seed'"):
        LLM(model=str(tiny_model_factory("tiny-llama", "llama")), override_generation_config={"seed": 1})


def test_waiting_for_the_kv_pool_leaves_every_cache_page_resident(llm):
    assert llm.wait_kv_cache_resident(timeout_s=120)
    caches = [cache for pair in llm.engine.executor.runner.kv_caches for cache in pair]
    spans = [whole_small_pages(cache) for cache in caches]  # the pages wholly each cache's
    assert caches and [resident_bytes(cache) for cache in caches] == [end - start for start, end in spans]
