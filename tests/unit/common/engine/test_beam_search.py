"""Beam search's bookkeeping (common.engine.beam_search) on scripted steps, and the offline
LLM.beam_search on a tiny random Llama against the model's own logprobs."""
from __future__ import annotations

import math

import pytest

from common import LLM, BeamSearchParams, SamplingParams
from common.engine.beam_search import MAX_BEAM_WIDTH, BeamSearch
from common.engine.outputs import Logprobs

EOS = 2


def step(*pairs: tuple[int, float]) -> Logprobs:
    """A step's 2 * beam_width best next tokens, as the engine reports them."""
    return Logprobs(token_logprob=pairs[0][1], top_token_ids=[t for t, _ in pairs], top_logprobs=[p for _, p in pairs])


def test_the_best_extensions_live_on_and_an_eos_ends_its_beam():
    search = BeamSearch([7, 8], BeamSearchParams(beam_width=2, max_tokens=2), eos_token_ids=[EOS], max_model_len=64)
    assert search.step_params.logprobs == 4 and search.step_params.max_tokens == 1
    search.advance([step((10, -0.1), (EOS, -0.5), (11, -1.0), (12, -3.0))])
    assert [b.token_ids for b in search.live] == [[7, 8, 10], [7, 8, 11]]
    assert [(b.token_ids, b.finish_reason) for b in search.ended] == [([7, 8, EOS], "stop")]
    # the second step: the two best extensions over both beams, by cumulative logprob
    search.advance([step((20, -2.0), (21, -2.5), (22, -4.0), (23, -5.0)),
                    step((30, -0.2), (31, -0.3), (32, -6.0), (33, -7.0))])
    assert search.done
    assert [(b.token_ids, round(b.cum_logprob, 3)) for b in search.live] == [([7, 8, 11, 30], -1.2),
                                                                               ([7, 8, 11, 31], -1.3)]
    # ranked by logprob / length: the EOS beam (-0.5 over 2 tokens) first
    assert [b.token_ids for b in search.best()] == [[7, 8, EOS], [7, 8, 11, 30]]
    assert search.shown_token_ids(search.best()[0]) == []  # its EOS is not shown ...
    kept = BeamSearch([7, 8], BeamSearchParams(beam_width=2, max_tokens=2, include_stop_str_in_output=True),
                      [EOS], 64)
    kept.advance([step((EOS, -0.1), (10, -0.5), (11, -1.0), (12, -3.0))])
    assert kept.shown_token_ids(kept.ended[0]) == [EOS]  # ... unless asked


def test_length_penalty_and_ignore_eos():
    ignoring = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True), [EOS], 64)
    ignoring.advance([step((EOS, -0.1), (5, -0.2))])
    assert not ignoring.ended and [b.token_ids for b in ignoring.live] == [[1, EOS]]
    # length_penalty 0 ranks by the plain sum (shorter wins); 2 favours the longer beam
    for penalty, expected in ((0.0, [1, EOS]), (2.0, [1, 5, 6])):
        search = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=penalty), [EOS], 64)
        search.advance([step((EOS, -1.0), (5, -1.1))])
        search.advance([step((6, -0.2), (7, -3.0))])
        assert search.best()[0].token_ids == expected


def test_bad_params_and_the_context_limit():
    with pytest.raises(ValueError, match=f"beam_width must be an integer in \\[1, {MAX_BEAM_WIDTH}\\]"):
        BeamSearchParams(beam_width=MAX_BEAM_WIDTH + 1, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    assert BeamSearch([1] * 60, BeamSearchParams(beam_width=2, max_tokens=None), [EOS], 64).num_steps == 4


@pytest.fixture
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), num_kv_blocks=128, block_size=8)


def test_offline_beam_search_ranks_by_the_models_own_logprobs(llm):
    prompts = [{"prompt_token_ids": [5, 17, 300 + i, 4000 + 7 * i]} for i in range(2)]
    greedy = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    one = llm.beam_search(prompts[0], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))[0]
    assert one.sequences[0].token_ids == prompts[0]["prompt_token_ids"] + greedy.outputs[0].token_ids
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        sequences = result.sequences
        assert len(sequences) == 3 and len({tuple(s.token_ids) for s in sequences}) == 3
        assert all(s.token_ids[:4] == prompt["prompt_token_ids"] and len(s.token_ids) == 8 for s in sequences)
        assert [s.cum_logprob for s in sequences] == sorted((s.cum_logprob for s in sequences), reverse=True)
        for s in sequences:  # each beam's logprob is the model's for its tokens after the prompt
            scored = llm.generate({"prompt_token_ids": s.token_ids},
                                  SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
            assert math.isclose(sum(lp.token_logprob for lp in scored[4:]), s.cum_logprob, abs_tol=1e-3)
            assert s.text == llm.tokenizer.decode(s.token_ids)
    assert not llm.engine.has_unfinished_requests()
