"""PromptPooler: a prompt's pooled state is the same however its tokens are split into
chunks and whatever else shares the steps; a prompt computed again starts over; chunks out
of order are refused."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.outputs import ScheduledRequest
from common.engine.pooling_params import POOLING_TYPES
from common.engine.prompt_pooler import PromptPooler
from common.engine.sampling_params import SamplingParams

HIDDEN_SIZE = 8


def _whole(states: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """The pooling of all of a prompt's states [num_tokens, hidden] at once (float64)."""
    states = states.double()
    num_tokens = states.shape[0]
    weights = torch.arange(1, num_tokens + 1, dtype=torch.float64)
    return {"LAST": lambda: states[-1], "MEAN": lambda: states.mean(0), "CLS": lambda: states[0],
            "MAX": lambda: states.max(0).values, "MEAN_SQRT_LEN": lambda: states.sum(0) / math.sqrt(num_tokens),
            "WEIGHTED_MEAN": lambda: weights @ states / weights.sum()}[pooling_type]()


def _chunk(req_id: str, start: int, num_tokens: int, num_prompt_tokens: int, pooling_type: str) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=[1] * num_tokens, start_pos=start, block_table=[],
                            do_sample=False, sampling_params=SamplingParams(),
                            do_pool=start + num_tokens == num_prompt_tokens,
                            pooling_type=None if pooling_type == "LAST" else pooling_type)


@st.composite
def _split_prompt(draw):
    num_tokens = draw(st.integers(1, 40))
    cuts = sorted(draw(st.sets(st.integers(1, num_tokens - 1), max_size=5))) if num_tokens > 1 else []
    bounds = [0, *cuts, num_tokens]
    states = torch.tensor(draw(st.lists(st.floats(-100, 100, width=32), min_size=num_tokens * HIDDEN_SIZE,
                                        max_size=num_tokens * HIDDEN_SIZE))).reshape(num_tokens, HIDDEN_SIZE)
    return states, list(zip(bounds, bounds[1:]))


@settings(max_examples=60, deadline=None)
@given(_split_prompt(), st.sampled_from(POOLING_TYPES), st.integers(0, 3))
def test_a_prompt_pooled_in_chunks_equals_it_pooled_whole(prompt, pooling_type, num_beside):
    states, chunks = prompt
    pooler = PromptPooler()
    pooled = None
    for start, end in chunks:
        # Each step also holds decode rows of other requests, before the chunk (their row order).
        beside = [_chunk(f"other-{i}", 7, 1, 100, "LAST") for i in range(num_beside)]
        hidden = torch.cat([torch.full((num_beside, HIDDEN_SIZE), 1e4), states[start:end]])
        out = pooler.pool_step([*beside, _chunk("r", start, end - start, states.shape[0], pooling_type)], hidden)
        assert out is None or set(out) == {"r"}
        pooled = out["r"] if out else pooled
        assert (out is not None) == (end == states.shape[0])
    torch.testing.assert_close(torch.tensor(pooled, dtype=torch.float64), _whole(states, pooling_type),
                               rtol=1e-5, atol=1e-4)
    assert pooler.num_partials == 0


def test_a_prompt_computed_again_from_position_0_starts_over():
    pooler, states = PromptPooler(), torch.arange(24.0).reshape(3, HIDDEN_SIZE)
    assert pooler.pool_step([_chunk("r", 0, 2, 3, "MEAN")], torch.full((2, HIDDEN_SIZE), 1e6)) is None
    # Preempted, its KV dropped: computed again from position 0.
    assert pooler.pool_step([_chunk("r", 0, 2, 3, "MEAN")], states[:2]) is None
    out = pooler.pool_step([_chunk("r", 2, 1, 3, "MEAN")], states[2:])
    assert out["r"] == states.mean(0).tolist()


def test_a_chunk_out_of_order_is_refused_and_remove_drops_partials():
    pooler = PromptPooler()
    with pytest.raises(RuntimeError, match="from position 4 .* nothing pooled before it"):
        pooler.pool_step([_chunk("r", 4, 2, 8, "MAX")], torch.zeros(2, HIDDEN_SIZE))
    pooler.pool_step([_chunk("r", 0, 2, 8, "MAX")], torch.zeros(2, HIDDEN_SIZE))
    with pytest.raises(RuntimeError, match="from position 3 .* 2 positions pooled before it"):
        pooler.pool_step([_chunk("r", 3, 2, 8, "MAX")], torch.zeros(2, HIDDEN_SIZE))
    pooler.remove(["r", "never-seen"])
    assert pooler.num_partials == 0
