"""The packed bitmask masks exactly the constrained rows, for greedy and sampled rows."""
from __future__ import annotations

import torch

from common.engine.outputs import ScheduledRequest
from common.engine.sampler import Sampler
from common.engine.sampling_params import SamplingParams
from common.engine.structured_output.bitmask import apply_token_bitmask


def bitmask_allowing(allowed: list[set[int]], vocab_size: int) -> torch.Tensor:
    num_words = (vocab_size + 31) // 32
    bitmask = torch.zeros(len(allowed), num_words, dtype=torch.int32)  # [rows, words]
    for row, tokens in enumerate(allowed):
        for token in tokens:
            word = int(bitmask[row, token // 32]) | (1 << (token % 32))
            bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return bitmask


def test_apply_masks_only_the_listed_rows():
    logits = torch.zeros(3, 70)
    apply_token_bitmask(logits, bitmask_allowing([{0, 31, 69}], 70), rows=[1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 31, 69]
    assert torch.isfinite(logits[[0, 2]]).all()


def scheduled(req_id: str, params: SamplingParams) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=[1], start_pos=0, block_table=[0], do_sample=True,
                            sampling_params=params, prompt_token_ids=[1])


def test_sampler_obeys_the_mask_greedy_and_sampled_and_leaves_other_rows_alone():
    vocab_size = 100
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(0))
    requests = [scheduled("greedy", SamplingParams(temperature=0.0)),
                scheduled("free", SamplingParams(temperature=0.0)),
                scheduled("sampled", SamplingParams(temperature=1.5, seed=7))]
    unconstrained = Sampler()(logits, requests).sampled_token_ids
    bitmask = bitmask_allowing([{5, 77}, {40, 41, 42}], vocab_size)
    for _ in range(20):
        tokens = Sampler()(logits, requests, bitmask, [0, 2]).sampled_token_ids
        assert tokens[0] in {5, 77} and tokens[2] in {40, 41, 42}
        assert tokens[1] == unconstrained[1]
    assert torch.isfinite(logits).all()  # the caller's logits are left alone
