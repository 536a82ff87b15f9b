"""Embedding requests in the engine: the final hidden states pooled as the model's
sentence-transformers config says (the last token's by default), equal to Hugging Face's
states so pooled, whatever the prompt's chunks and prefix-cache hits, beside generation
requests, leaving no blocks behind; LLM.score's scores the cosines of its vectors."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from common.engine.llm import LLM
from common.engine.pooling_params import (MAX_EMBEDDING_DIMENSIONS, PoolingConfig, PoolingParams,
                                          parse_pooler_config)
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.engine.scoring import cosine_similarity

PROMPTS = [[(13 * i + 7 * j) % 400 + 3 for i in range(n)] for j, n in enumerate((5, 37, 64, 1))]


def _hf_hidden_states(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    import transformers
    model = transformers.AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([ids])).last_hidden_state[0] for ids in prompts]  # each [num_tokens, hidden]


def _hf_last_hidden_states(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [states[-1] for states in _hf_hidden_states(model_dir, prompts)]  # each [hidden]


def _st_pooled(states: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """sentence-transformers' pooling of one prompt's final hidden states [num_tokens, hidden]."""
    num_tokens = states.shape[0]
    if pooling_type == "MEAN":
        return states.mean(dim=0)
    if pooling_type == "CLS":
        return states[0]
    if pooling_type == "MAX":
        return states.max(dim=0).values
    if pooling_type == "MEAN_SQRT_LEN":
        return states.sum(dim=0) / math.sqrt(num_tokens)
    weights = torch.arange(1, num_tokens + 1, dtype=states.dtype)  # WEIGHTED_MEAN
    return (weights[:, None] * states).sum(dim=0) / weights.sum()


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    return tiny_model_factory("tiny-llama", "llama")


@pytest.fixture(scope="module")
def llm(tiny_dir):
    engine = LLM(model=str(tiny_dir), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=32)
    yield engine
    engine.engine.shutdown()


def _assert_close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want.float(), rtol=1e-4, atol=1e-4)


def _free_blocks(llm: LLM) -> int:
    return llm.engine.scheduler.kv_cache_manager.block_pool.num_free_blocks


def test_embeddings_equal_hugging_face_last_hidden_state(llm, tiny_dir):
    """Chunked (37 and 64 tokens over a 32-token budget), one-token and short prompts in one call."""
    want = _hf_last_hidden_states(tiny_dir, PROMPTS)
    raw = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(normalize=False))
    normed = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
    for out, normed_out, hidden, prompt in zip(raw, normed, want, PROMPTS):
        assert out.prompt_token_ids == prompt and out.finished
        _assert_close(out.outputs.embedding, hidden)
        _assert_close(normed_out.outputs.embedding, torch.nn.functional.normalize(hidden, dim=0))
        assert math.isclose(math.fsum(v * v for v in normed_out.outputs.embedding), 1.0, rel_tol=1e-6)


def test_a_cached_prefix_gives_the_same_embedding_and_no_blocks_stay_held(llm):
    prompt = {"prompt_token_ids": PROMPTS[2]}
    free_before = _free_blocks(llm)
    first = llm.embed(prompt)[0]
    again = llm.embed(prompt)[0]
    assert again.num_cached_tokens > 0  # only the tail ran
    assert again.outputs.embedding == pytest.approx(first.outputs.embedding, abs=1e-5)
    assert _free_blocks(llm) == free_before
    assert not llm.engine.has_unfinished_requests()


def test_embedding_requests_beside_generation_change_no_token(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.reset_prefix_cache()
    engine = llm.engine
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(Request(f"gen-{i}", p, params))
        engine.add_request(Request(f"emb-{i}", p[::-1], SamplingParams(max_tokens=1),
                                   pooling_params=PoolingParams()))
    tokens: dict[str, list[int]] = {}
    embeddings: dict[str, list[float]] = {}
    finish_reasons: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.embedding is not None:
                embeddings[out.req_id] = out.embedding
            if out.finished:
                finish_reasons[out.req_id] = out.finish_reason
    assert [tokens[f"gen-{i}"] for i in range(3)] == alone
    assert set(embeddings) == {f"emb-{i}" for i in range(3)}
    assert all(tokens.get(f"emb-{i}", []) == [] for i in range(3))
    assert all(finish_reasons[f"emb-{i}"] == "stop" for i in range(3))
    want = llm.embed([{"prompt_token_ids": p[::-1]} for p in PROMPTS[:3]])
    for i, out in enumerate(want):
        assert embeddings[f"emb-{i}"] == pytest.approx(out.outputs.embedding, abs=1e-5)


def test_an_embedding_aborted_mid_prompt_leaves_nothing(llm):
    engine = llm.engine
    free_before = _free_blocks(llm)
    uncached = [(29 * i) % 500 + 11 for i in range(64)]
    engine.add_request(Request("emb-abort", uncached, SamplingParams(max_tokens=1),
                               pooling_params=PoolingParams()))
    outputs = engine.step()  # the first 32-token chunk of 64
    assert not outputs
    aborted = engine.abort_requests(["emb-abort"])
    assert [o.finish_reason for o in aborted] == ["abort"]
    assert [o for o in engine.step() if o.embedding is not None] == []
    assert not engine.has_unfinished_requests()
    assert _free_blocks(llm) == free_before


def test_dimensions_need_a_matryoshka_model(llm, tiny_model_factory):
    with pytest.raises(ValueError, match="does not support Matryoshka representation"):
        llm.embed("Hello", PoolingParams(dimensions=16))
    model_dir = tiny_model_factory("tiny-llama-matryoshka", "llama", matryoshka_dimensions=[16, 32])
    nested = LLM(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB", enforce_eager=True)
    try:
        with pytest.raises(ValueError, match=r"supports only \[16, 32\], got 8"):
            nested.embed("Hello", PoolingParams(dimensions=8))
        full = nested.embed("Hello", PoolingParams(normalize=False))[0].outputs.embedding
        cut = nested.embed("Hello", PoolingParams(dimensions=16))[0].outputs.embedding
        assert len(full) == 64 and len(cut) == 16
        _assert_close(cut, torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0))
    finally:
        nested.engine.shutdown()


def test_llm_score_is_the_cosine_of_llm_embed(llm):
    queries = [{"prompt_token_ids": [5, 9, 11]}, {"prompt_token_ids": [40, 41, 42, 43]}]
    documents = [{"prompt_token_ids": [5, 9, 12]}, {"prompt_token_ids": list(range(30, 70))}]
    vectors = [out.outputs.embedding for out in llm.embed(queries + documents, PoolingParams(normalize=False))]
    one_to_many = llm.score(queries[0], documents)
    assert [out.outputs.score for out in one_to_many] == pytest.approx(
        [cosine_similarity(vectors[0], vectors[2]), cosine_similarity(vectors[0], vectors[3])], abs=1e-5)
    assert one_to_many[1].prompt_token_ids == [5, 9, 11] + list(range(30, 70))
    pairwise = llm.score(queries, documents)
    assert [out.outputs.score for out in pairwise] == pytest.approx(
        [cosine_similarity(vectors[0], vectors[2]), cosine_similarity(vectors[1], vectors[3])], abs=1e-5)
    assert llm.score(queries[1], queries[1])[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(queries, documents + queries)
    assert not llm.engine.has_unfinished_requests()


def test_bad_prompts_are_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="out of"):
        llm.embed([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [10**9]}])
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.embed({"prompt_token_ids": [5] * (llm.max_model_len + 1)})
    assert not llm.engine.has_unfinished_requests()
    out = llm.embed({"prompt_token_ids": [5] * (llm.max_model_len + 1)}, truncate_prompt_tokens=8)[0]
    assert out.prompt_token_ids == [5] * 8


def with_sentence_transformers(model_dir, out_dir, pooling_flag: str | list[str], normalize: bool):
    """A copy of model_dir with a sentence-transformers config: a Pooling module by
    pooling_flag (several: their poolings concatenated), and a Normalize module if asked."""
    shutil.copytree(model_dir, out_dir)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out_dir / "modules.json").write_text(json.dumps(modules))
    (out_dir / "1_Pooling").mkdir()
    flags = [pooling_flag] if isinstance(pooling_flag, str) else pooling_flag
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64}
                                                                  | dict.fromkeys(flags, True)))
    return out_dir


def test_the_models_sentence_transformers_config_sets_pooling_and_normalize(tiny_dir, tmp_path):
    assert PoolingConfig.from_model_dir(tiny_dir) == PoolingConfig("LAST", True)  # none: vLLM's defaults
    last = with_sentence_transformers(tiny_dir, tmp_path / "last", "pooling_mode_lasttoken", normalize=False)
    mean = with_sentence_transformers(tiny_dir, tmp_path / "mean", "pooling_mode_mean_tokens", normalize=True)
    assert PoolingConfig.from_model_dir(last) == PoolingConfig("LAST", False)
    assert PoolingConfig.from_model_dir(mean) == PoolingConfig("MEAN", True)
    want = _hf_last_hidden_states(tiny_dir, PROMPTS[:1])[0]
    llm = LLM(model=str(last), dtype="float32", kv_cache_memory="16MiB", enforce_eager=True)
    try:
        prompt = {"prompt_token_ids": PROMPTS[0]}
        _assert_close(llm.embed(prompt)[0].outputs.embedding, want)  # no Normalize module: the raw state
        _assert_close(llm.embed(prompt, PoolingParams(normalize=True))[0].outputs.embedding,
                      torch.nn.functional.normalize(want, dim=0))
    finally:
        llm.engine.shutdown()
    both = with_sentence_transformers(tiny_dir, tmp_path / "both", ["pooling_mode_mean_tokens",
                                                                    "pooling_mode_max_tokens"], normalize=True)
    assert PoolingConfig.from_model_dir(both) == PoolingConfig("MEAN+MAX", True)
    llm = LLM(model=str(both), dtype="float32", kv_cache_memory="16MiB", enforce_eager=True)
    try:
        with pytest.raises(ValueError, match="concatenates MEAN [+] MAX; pdserve pools one way per model"):
            llm.embed("Hello")
        assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # generation still serves
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.engine.shutdown()


_ST_FLAGS = {"MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token", "MAX": "pooling_mode_max_tokens",
             "MEAN_SQRT_LEN": "pooling_mode_mean_sqrt_len_tokens", "WEIGHTED_MEAN": "pooling_mode_weightedmean_tokens"}


@pytest.mark.parametrize("pooling_type", list(_ST_FLAGS))
def test_each_pooling_over_every_token_gives_sentence_transformers_vector(tiny_dir, tmp_path, pooling_type):
    """Prompts of 5, 37, 64 and 1 tokens over a 32-token budget, in one call: pooled across
    their chunks; embedded again, computed whole (no prefix-cache hit to skip states), while a
    generation of the same prompt still takes the cached blocks."""
    model_dir = with_sentence_transformers(tiny_dir, tmp_path / "st", _ST_FLAGS[pooling_type], normalize=False)
    want = [_st_pooled(states, pooling_type) for states in _hf_hidden_states(tiny_dir, PROMPTS)]
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=32,
              enforce_eager=True)
    try:
        free_before = _free_blocks(llm)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        for attempt in range(2):
            outs = llm.embed(prompts)
            for out, vector in zip(outs, want):
                _assert_close(out.outputs.embedding, vector)  # no Normalize module: the raw pooled state
                assert out.num_cached_tokens == 0, attempt
        normed = llm.embed(prompts[1], PoolingParams(normalize=True))[0].outputs.embedding
        _assert_close(normed, torch.nn.functional.normalize(want[1], dim=0))
        # A cached prefix still serves generation: only the pooled requests skip it.
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        assert llm.generate(prompts[2], params)[0].num_cached_tokens > 0
        assert _free_blocks(llm) == free_before
        assert llm.engine.executor.runner.prompt_pooler.num_partials == 0
    finally:
        llm.engine.shutdown()


def test_a_mean_pooled_embedding_aborted_mid_prompt_leaves_no_partial(tiny_dir, tmp_path):
    model_dir = with_sentence_transformers(tiny_dir, tmp_path / "mean", "pooling_mode_mean_tokens", normalize=True)
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=32,
              enforce_eager=True)
    try:
        engine, runner = llm.engine, llm.engine.executor.runner
        free_before = _free_blocks(llm)
        engine.add_request(Request("emb-abort", PROMPTS[2], SamplingParams(max_tokens=1),
                                   pooling_params=engine.pooling_params_for(None)))
        assert not engine.step()  # the first 32-token chunk of 64
        assert runner.prompt_pooler.num_partials == 1
        assert [o.finish_reason for o in engine.abort_requests(["emb-abort"])] == ["abort"]
        assert [o for o in engine.step() if o.embedding is not None] == []
        assert runner.prompt_pooler.num_partials == 0
        assert not engine.has_unfinished_requests() and _free_blocks(llm) == free_before
        # The next embedding of the same prompt is the whole prompt's mean, not a mix with the first chunk.
        want = torch.nn.functional.normalize(_hf_hidden_states(tiny_dir, PROMPTS[2:3])[0].mean(dim=0), dim=0)
        _assert_close(llm.embed({"prompt_token_ids": PROMPTS[2]})[0].outputs.embedding, want)
    finally:
        llm.engine.shutdown()


def test_pooler_config_overrides_the_models_pooling(tiny_dir, tmp_path):
    mean = with_sentence_transformers(tiny_dir, tmp_path / "mean", "pooling_mode_mean_tokens", normalize=True)
    llm = LLM(model=str(mean), dtype="float32", kv_cache_memory="16MiB", enforce_eager=True,
              pooler_config='{"pooling_type": "cls", "use_activation": false}')
    try:
        assert llm.engine.pooling_config == PoolingConfig("CLS", False)
        want = _hf_hidden_states(tiny_dir, PROMPTS[1:2])[0][0]
        _assert_close(llm.embed({"prompt_token_ids": PROMPTS[1]})[0].outputs.embedding, want)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("value, match", [
    ('{"pooling_type": "SUM"}', "pooling_type must be one of LAST, MEAN, CLS"),
    ({"pooling_type": 3}, "pooling_type must be one of"),
    ('{"normalize": 1}', "normalize must be true or false"),
    ({"normalize": True, "use_activation": False}, "sets normalize twice, to True and False"),
    ('{"task": "embed"}', r"unknown pooler_config keys \['task'\]"),
    ("mean", "--pooler-config is not valid JSON"),
    ("[1]", "pooler_config must be a JSON object; got list"),
])
def test_pooler_config_refuses_bad_values(value, match):
    with pytest.raises(ValueError, match=match):
        parse_pooler_config(value)


@pytest.mark.parametrize("kwargs, match", [
    ({"normalize": 1}, "normalize must be a boolean"),
    ({"dimensions": 0}, "dimensions must be an integer from 1"),
    ({"dimensions": True}, "dimensions must be an integer"),
    ({"dimensions": MAX_EMBEDDING_DIMENSIONS + 1}, "dimensions must be an integer"),
])
def test_pooling_params_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=64), st.integers(1, 64))
def test_pool_normalizes_the_cut_vector(values, dimensions):
    cut = PoolingParams(normalize=False, dimensions=dimensions).pool(values)
    assert cut == values[:dimensions]
    normed = PoolingParams(normalize=True, dimensions=dimensions).pool(values)
    assert PoolingParams(dimensions=dimensions).pool(values) == normed  # unset: normalized
    norm = math.sqrt(math.fsum(v * v for v in cut))
    if norm > 1e-12:
        assert math.isclose(math.fsum(v * v for v in normed), 1.0, rel_tol=1e-9)
        assert all(math.isclose(n * norm, v, rel_tol=1e-9, abs_tol=1e-9) for n, v in zip(normed, cut))
    else:  # the norm floored as torch's F.normalize floors it
        assert normed == [v / 1e-12 for v in cut]
