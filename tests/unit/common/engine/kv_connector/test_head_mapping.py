"""Which prefill rank sends which KV heads to which decode rank."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.engine.kv_connector.head_mapping import (
    HeadSlice,
    KVLayoutMismatchError,
    check_pool_pairing,
    plan_head_slices,
)
from common.engine.models.parallel_layers import kv_head_partition


def test_equal_sizes_pair_rank_with_rank():
    assert plan_head_slices(4, 2, 2) == [HeadSlice(0, 0, 0, 0, 2), HeadSlice(1, 1, 0, 0, 2)]


def test_two_prefill_ranks_fill_one_decode_rank():
    assert plan_head_slices(4, 2, 1) == [HeadSlice(0, 0, 0, 0, 2), HeadSlice(1, 0, 0, 2, 2)]


def test_one_prefill_rank_feeds_two_decode_ranks():
    assert plan_head_slices(4, 1, 2) == [HeadSlice(0, 0, 0, 0, 2), HeadSlice(0, 1, 2, 0, 2)]


def test_replicated_heads_spread_the_decode_ranks_over_the_replicas():
    # 2 KV heads on 4 prefill ranks: head 0 on ranks 0-1, head 1 on ranks 2-3.
    assert plan_head_slices(2, 4, 2) == [HeadSlice(0, 0, 0, 0, 1), HeadSlice(3, 1, 0, 0, 1)]
    # ... and to 4 decode ranks: each replica feeds one decode replica.
    assert plan_head_slices(2, 4, 4) == [HeadSlice(r, r, 0, 0, 1) for r in range(4)]


@given(num_kv_heads=st.sampled_from([1, 2, 3, 4, 8]), src=st.sampled_from([1, 2, 3, 4, 8]),
       dst=st.sampled_from([1, 2, 3, 4, 8]))
def test_every_decode_head_comes_exactly_once_from_a_rank_that_holds_it(num_kv_heads, src, dst):
    def valid(tp):
        return (tp < num_kv_heads and num_kv_heads % tp == 0) or (tp >= num_kv_heads and tp % num_kv_heads == 0)
    if not (valid(src) and valid(dst)):
        with pytest.raises(KVLayoutMismatchError, match="cannot be split"):
            plan_head_slices(num_kv_heads, src, dst)
        return
    covered: dict[tuple[int, int], int] = {}
    for s in plan_head_slices(num_kv_heads, src, dst):
        src_first, src_count = kv_head_partition(num_kv_heads, s.src_rank, src)
        dst_first, dst_count = kv_head_partition(num_kv_heads, s.dst_rank, dst)
        assert s.num_heads >= 1 and s.src_start + s.num_heads <= src_count and s.dst_start + s.num_heads <= dst_count
        for i in range(s.num_heads):
            assert src_first + s.src_start + i == dst_first + s.dst_start + i  # the same global head
            covered[(s.dst_rank, s.dst_start + i)] = covered.get((s.dst_rank, s.dst_start + i), 0) + 1
    want = {(d, h) for d in range(dst) for h in range(kv_head_partition(num_kv_heads, d, dst)[1])}
    assert set(covered) == want and set(covered.values()) == {1}


def test_pairing_accepts_any_valid_split_and_names_both_layouts_otherwise():
    check_pool_pairing(num_kv_heads=4, head_dim=8, block_size=16, src_tp_size=2, dst_tp_size=1,
                       dst_block_shape=[16, 4, 8])
    check_pool_pairing(num_kv_heads=4, head_dim=8, block_size=16, src_tp_size=1, dst_tp_size=4,
                       dst_block_shape=[16, 1, 8])
    with pytest.raises(KVLayoutMismatchError, match=r"2 decode rank\(s\) with blocks \[16, 4, 8\].*make \[16, 2, 8\]"
                                                    r".*tensor parallel size 1"):
        check_pool_pairing(num_kv_heads=4, head_dim=8, block_size=16, src_tp_size=1, dst_tp_size=2,
                           dst_block_shape=[16, 4, 8])
    with pytest.raises(KVLayoutMismatchError, match=r"cannot be mapped: 4 KV heads cannot be split over 3"):
        check_pool_pairing(num_kv_heads=4, head_dim=8, block_size=16, src_tp_size=1, dst_tp_size=3,
                           dst_block_shape=[16, 1, 8])
