"""BlockPool and KVCacheManager: exact block ids, eviction order, prefix hits, events."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.block_hash import compute_block_hashes, hash_block_tokens, root_parent_hash
from common.engine.block_pool import BlockRemoved, BlockStored
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(req_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(req_id, prompt_token_ids, SamplingParams())


def admit(kv, request: Request) -> list[int]:
    """What the scheduler does for a new request: look up the prefix, allocate the rest."""
    hit_block_ids, num_hit_tokens = kv.get_computed_blocks(request)
    new_block_ids = kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hit_block_ids)
    assert new_block_ids is not None
    request.num_computed_tokens = request.num_tokens
    return new_block_ids


def free_queue_ids(kv) -> list[int]:
    """The free blocks in the order allocation takes them."""
    return kv.block_pool.free_block_ids()


def test_allocates_exact_block_ids_and_evicts_empty_blocks_then_cached_tails(make_kv_cache_manager):
    kv = make_kv_cache_manager(num_blocks=8)
    req_a = make_request("a", list(range(10)))
    req_b = make_request("b", list(range(100, 105)))
    assert admit(kv, req_a) == [0, 1, 2]
    assert admit(kv, req_b) == [3, 4]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 3 and kv.usage == pytest.approx(5 / 8)
    kv.check_invariants()

    kv.free(req_a)
    # Empty blocks go first, lowest id first (block 2 held a's partial tail); then the
    # cached ones, the request's tail first and its first block last.
    assert free_queue_ids(kv) == [2, 5, 6, 7, 1, 0]
    kv.free(req_b)
    assert free_queue_ids(kv) == [2, 4, 5, 6, 7, 1, 0, 3]
    assert kv.get_block_ids("a") == []


def test_prefix_hit_reuses_exact_block_ids(make_kv_cache_manager):
    kv = make_kv_cache_manager(num_blocks=8)
    req_a = make_request("a", list(range(10)))
    admit(kv, req_a)  # blocks 0 and 1 are full and cached, block 2 is partial
    req_b = make_request("b", list(range(8)) + [100, 101, 102])
    assert kv.get_computed_blocks(req_b) == ([0, 1], 8)
    assert kv.allocate_slots(req_b, 3, [0, 1]) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]

    kv.free(req_a)  # only the unshared block 2 becomes free
    assert free_queue_ids(kv) == [2, 4, 5, 6, 7]
    kv.free(req_b)
    assert free_queue_ids(kv) == [2, 3, 4, 5, 6, 7, 1, 0]

    # A hit on free blocks takes them out of the middle of the free queue.
    req_c = make_request("c", list(range(8)) + [7])
    assert kv.get_computed_blocks(req_c) == ([0, 1], 8)
    assert kv.allocate_slots(req_c, 1, [0, 1]) == [2]
    assert free_queue_ids(kv) == [3, 4, 5, 6, 7]
    kv.check_invariants()
    kv.free(req_c)
    assert kv.stats.num_query_tokens == 10 + 11 + 9 and kv.stats.num_hit_tokens == 16


def test_only_requests_of_the_same_cache_salt_share_blocks(make_kv_cache_manager):
    kv = make_kv_cache_manager(num_blocks=16)
    prompt = list(range(9))
    salted = Request("a", prompt, SamplingParams(), cache_salt="tenant-a")
    admit(kv, salted)
    assert salted.block_hashes == compute_block_hashes(prompt, BLOCK_SIZE, root_parent_hash("tenant-a"))
    assert salted.block_hashes != compute_block_hashes(prompt, BLOCK_SIZE)
    for other in (make_request("unsalted", prompt), Request("b", prompt, SamplingParams(), cache_salt="tenant-b")):
        assert kv.get_computed_blocks(other) == ([], 0)  # another salt, or none: a miss
    same = Request("a2", prompt, SamplingParams(), cache_salt="tenant-a")
    assert kv.get_computed_blocks(same) == (kv.get_block_ids("a")[:2], 8)
    with pytest.raises(ValueError, match="must not contain"):
        Request("c", prompt, SamplingParams(), cache_salt="a/b")
    with pytest.raises(ValueError, match="non-empty"):
        Request("c", prompt, SamplingParams(), cache_salt="")


def test_whole_prompt_cached_drops_last_block(make_kv_cache_manager):
    kv = make_kv_cache_manager()
    req_a = make_request("a", list(range(8)))
    admit(kv, req_a)
    kv.free(req_a)
    # Same 8 tokens: both blocks are cached, but the last token must be recomputed.
    assert kv.get_computed_blocks(make_request("b", list(range(8)))) == ([0], 4)
    assert kv.get_computed_blocks(make_request("c", list(range(9)))) == ([0, 1], 8)
    assert kv.get_computed_blocks(make_request("d", list(range(7)))) == ([0], 4)
    assert kv.get_computed_blocks(make_request("e", [0, 1, 2])) == ([], 0)


def test_failed_allocation_changes_nothing(make_kv_cache_manager):
    kv = make_kv_cache_manager(num_blocks=4)
    req_a = make_request("a", list(range(8)))
    admit(kv, req_a)
    kv.free(req_a)
    admit(kv, make_request("other", [50]))  # takes block 2, the head of the free queue
    kv.take_events()
    before = (free_queue_ids(kv), [(b.ref_cnt, b.block_hash) for b in kv.block_pool.blocks])

    # Two free cached hits + two new blocks = 4 > 3 free blocks.
    req_b = make_request("b", list(range(8)) + list(range(200, 208)))
    hit_block_ids, num_hit_tokens = kv.get_computed_blocks(req_b)
    assert (hit_block_ids, num_hit_tokens) == ([0, 1], 8)
    assert kv.allocate_slots(req_b, 8, hit_block_ids) is None
    assert (free_queue_ids(kv), [(b.ref_cnt, b.block_hash) for b in kv.block_pool.blocks]) == before
    assert kv.get_block_ids("b") == [] and kv.take_events() == []
    # One new block fits: 2 hits + 1 new = 3 free.
    assert kv.allocate_slots(req_b, 4, hit_block_ids) == [3]


def test_reallocation_evicts_hash_with_block_removed_event(make_kv_cache_manager):
    kv = make_kv_cache_manager(num_blocks=4)
    req_a = make_request("a", list(range(8)))
    admit(kv, req_a)
    hash_a0, hash_a1 = req_a.block_hashes
    assert kv.take_events() == [BlockStored(seq=1, block_hashes=[hash_a0, hash_a1], parent_block_hash=None,
                                            token_ids=list(range(8)), block_size=BLOCK_SIZE)]
    kv.free(req_a)
    assert free_queue_ids(kv) == [2, 3, 1, 0]
    assert sorted(kv.all_cached_block_hashes()) == sorted([hash_a0, hash_a1])  # freed, still cached

    req_b = make_request("b", list(range(100, 116)))
    # Taken in that order, evicting a's tail first; handed out in ascending id order.
    assert admit(kv, req_b) == [0, 1, 2, 3]
    events = kv.take_events()
    assert events[0] == BlockRemoved(seq=2, block_hashes=[hash_a1, hash_a0])
    assert events[1] == BlockStored(seq=3, block_hashes=req_b.block_hashes, parent_block_hash=None,
                                    token_ids=list(range(100, 116)), block_size=BLOCK_SIZE)
    assert kv.last_event_seq == 3 and kv.take_events() == []
    assert kv.all_cached_block_hashes() == req_b.block_hashes
    assert kv.get_computed_blocks(make_request("a2", list(range(9)))) == ([], 0)
    kv.free(req_b)


def test_decode_tokens_fill_blocks_incrementally(make_kv_cache_manager):
    kv = make_kv_cache_manager()
    req = make_request("a", list(range(6)))
    assert admit(kv, req) == [0, 1]
    assert len(req.block_hashes) == 1
    kv.take_events()
    for token_id in (6, 7, 8):  # one decode step each: the token sampled last is computed now
        req.append_output_token_ids([token_id])
        assert kv.allocate_slots(req, 1) == ([2] if token_id == 8 else [])
        req.num_computed_tokens += 1
    # Block 1 became full with token 7 (its KV computed in the step that got token 8).
    assert req.block_hashes == compute_block_hashes(req.all_token_ids, BLOCK_SIZE)
    assert kv.take_events() == [BlockStored(seq=2, block_hashes=[req.block_hashes[1]],
                                            parent_block_hash=req.block_hashes[0],
                                            token_ids=[4, 5, 6, 7], block_size=BLOCK_SIZE)]
    kv.free(req)


def test_block_hashes_are_extended_not_recomputed(make_kv_cache_manager):
    kv = make_kv_cache_manager()
    req = make_request("a", list(range(5)))
    kv.get_computed_blocks(req)
    req.block_hashes[0] = 12345  # a recomputation would overwrite this
    req.append_output_token_ids([5, 6, 7])
    kv.get_computed_blocks(req)
    assert req.block_hashes == [12345, hash_block_tokens(12345, [4, 5, 6, 7])]


def test_concurrent_duplicate_blocks_keep_the_first_copy(make_kv_cache_manager):
    kv = make_kv_cache_manager()
    req_a, req_b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    lookup_b = kv.get_computed_blocks(req_b)  # before a registers anything: a miss
    admit(kv, req_a)
    assert lookup_b == ([], 0)
    assert kv.allocate_slots(req_b, 9, []) == [3, 4, 5]
    assert [kv.block_pool.blocks[i].block_hash for i in (3, 4)] == [None, None]
    assert len(kv.take_events()) == 1
    kv.free(req_a)
    kv.free(req_b)
    assert kv.get_computed_blocks(make_request("c", list(range(9)))) == ([0, 1], 8)


def test_reset_prefix_cache_and_disabled_caching(make_kv_cache_manager):
    kv = make_kv_cache_manager()
    req = make_request("a", list(range(9)))
    admit(kv, req)
    kv.take_events()
    kv.reset_prefix_cache()
    assert kv.take_events() == [BlockRemoved(seq=2, block_hashes=req.block_hashes)]
    assert kv.all_cached_block_hashes() == []
    kv.free(req)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)

    kv_off = make_kv_cache_manager(enable_prefix_caching=False)
    req = make_request("a", list(range(9)))
    admit(kv_off, req)
    kv_off.free(req)
    req_b = make_request("b", list(range(9)))
    assert kv_off.get_computed_blocks(req_b) == ([], 0) and req_b.block_hashes == []
    assert kv_off.take_events() == [] and kv_off.stats.num_query_tokens == 0


def test_check_invariants_detects_corruption(make_kv_cache_manager):
    kv = make_kv_cache_manager()
    req = make_request("a", list(range(5)))
    admit(kv, req)
    kv.block_pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        kv.check_invariants()
    kv.block_pool.blocks[0].ref_cnt -= 1
    kv.free(req)


def test_requests_that_finish_out_of_order_leave_ascending_runs_for_the_next(make_kv_cache_manager):
    """Blocks freed in whatever order requests finish come back lowest id first, so a new
    request's blocks lie in one ascending run of the cache once the prefixes are gone."""
    kv = make_kv_cache_manager(num_blocks=12)
    requests = [make_request(name, [100 * index + t for t in range(10)]) for index, name in enumerate("abcd")]
    for request in requests:
        admit(kv, request)  # 3 blocks each: a [0, 1, 2] ... d [9, 10, 11]
    for index in (2, 0, 3, 1):
        kv.free(requests[index])
    kv.reset_prefix_cache()
    assert free_queue_ids(kv) == list(range(12))
    assert admit(kv, make_request("e", list(range(1000, 1024)))) == list(range(6))
    assert admit(kv, make_request("f", list(range(2000, 2010)))) == [6, 7, 8]


def test_a_cached_prefix_outlives_empty_blocks(make_kv_cache_manager):
    kv = make_kv_cache_manager(num_blocks=8)
    old = make_request("old", list(range(8)))  # two full blocks, both cached
    admit(kv, old)
    kv.free(old)
    # Six empty blocks free: a request of five blocks takes empty ones and leaves the
    # prefix cached (one queue in free order would have evicted it first).
    filler = make_request("filler", list(range(100, 120)))
    assert admit(kv, filler) == [2, 3, 4, 5, 6]
    assert kv.get_computed_blocks(make_request("again", list(range(9)))) == ([0, 1], 8)
    kv.free(filler)


def test_an_allocation_past_the_empty_blocks_evicts_cached_ones_in_free_order(make_kv_cache_manager):
    kv = make_kv_cache_manager(num_blocks=6)
    first, second = make_request("first", list(range(8))), make_request("second", list(range(50, 58)))
    admit(kv, first)   # [0, 1]
    admit(kv, second)  # [2, 3]
    kv.free(second)
    kv.free(first)
    assert free_queue_ids(kv) == [4, 5, 3, 2, 1, 0]
    kv.take_events()
    # Two empty blocks, then second's tail and head: first's prefix survives.
    taker = make_request("taker", list(range(200, 216)))
    assert admit(kv, taker) == [2, 3, 4, 5]
    assert kv.take_events()[0] == BlockRemoved(seq=3, block_hashes=list(reversed(second.block_hashes)))
    assert kv.get_computed_blocks(make_request("first-again", list(range(9)))) == ([0, 1], 8)
    kv.free(taker)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "free", "reset"]), st.integers(0, 5), st.integers(1, 14)),
                max_size=40))
def test_any_run_of_admits_frees_and_resets_keeps_the_pool_whole(operations):
    """Whatever happens, the free blocks are exactly those no request holds, each listed
    once, empty ones first in ascending order, and every allocation ascends."""
    from common.engine.kv_cache_manager import KVCacheManager
    kv = KVCacheManager(16, BLOCK_SIZE, True, True)
    live: dict[str, Request] = {}
    for number, (operation, prefix, length) in enumerate(operations):
        if operation == "admit":
            # Prompts share a prefix chosen from a few, so hits and evictions both occur.
            request = make_request(f"r{number}", [prefix] * 4 + list(range(number * 100, number * 100 + length)))
            hit_block_ids, num_hit_tokens = kv.get_computed_blocks(request)
            new_block_ids = kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hit_block_ids)
            if new_block_ids is not None:
                assert new_block_ids == sorted(new_block_ids)
                request.num_computed_tokens = request.num_tokens
                live[request.req_id] = request
        elif operation == "free" and live:
            kv.free(live.pop(sorted(live)[prefix % len(live)]))
        elif operation == "reset":
            kv.reset_prefix_cache()
        kv.check_invariants()
        pool = kv.block_pool
        free_ids = pool.free_block_ids()
        num_empty = sum(1 for block_id in free_ids if pool.blocks[block_id].block_hash is None)
        assert free_ids[:num_empty] == sorted(free_ids[:num_empty])
        assert all(pool.blocks[block_id].block_hash is not None for block_id in free_ids[num_empty:])
    for request in live.values():
        kv.free(request)
    assert kv.num_free_blocks == 16


def _decode_to(kv, request: Request, num_tokens: int) -> list[list[int]]:
    """Grow a running request one decode token at a time to num_tokens; the block ids each
    allocation returned (only those that took blocks)."""
    allocations = []
    while request.num_tokens < num_tokens:
        request.append_output_token_ids([7])
        new_block_ids = kv.allocate_slots(request, 1)
        assert new_block_ids is not None
        if new_block_ids:
            allocations.append(new_block_ids)
        request.num_computed_tokens = request.num_tokens
    return allocations


def test_growing_requests_take_their_blocks_in_runs(make_kv_cache_manager):
    kv = make_kv_cache_manager(num_blocks=64, num_blocks_ahead=3)
    params = SamplingParams(max_tokens=100)
    first, second = Request("first", list(range(10)), params), Request("second", list(range(50, 60)), params)
    assert admit(kv, first) == [0, 1, 2, 3, 4, 5]    # 3 blocks for the prompt, 3 ahead
    assert admit(kv, second) == [6, 7, 8, 9, 10, 11]
    # Both decode side by side; each new block comes with 3 more, so neither request's
    # blocks interleave with the other's one block at a time.
    for num_tokens in range(11, 40):
        for request in (first, second):
            _decode_to(kv, request, num_tokens)
    assert kv.get_block_ids("first") == [0, 1, 2, 3, 4, 5, 12, 13, 14, 15]
    assert kv.get_block_ids("second") == [6, 7, 8, 9, 10, 11, 16, 17, 18, 19]
    kv.free(first)
    kv.free(second)


def test_blocks_ahead_stop_at_what_max_tokens_can_fill(make_kv_cache_manager):
    kv = make_kv_cache_manager(num_blocks=64, num_blocks_ahead=7)
    short = Request("short", list(range(10)), SamplingParams(max_tokens=3))  # 13 tokens: 4 blocks
    assert admit(kv, short) == [0, 1, 2, 3]
    assert _decode_to(kv, short, 13) == []
    unbounded = Request("unbounded", list(range(50, 60)), SamplingParams(max_tokens=None))
    assert admit(kv, unbounded) == list(range(4, 14))  # 3 + 7: until EOS, as many as allowed
    kv.free(short)
    kv.free(unbounded)


def _first_request_past_a_cached_prefix(make_kv_cache_manager) -> tuple:
    """16 blocks, up to 7 ahead: a two-block prefix cached and free, then `first` (10 tokens,
    max_tokens 100) admitted from the 14 empty blocks: its 3, then as many more as leave 8
    empty (3). Returns (kv, first)."""
    kv = make_kv_cache_manager(num_blocks=16, num_blocks_ahead=7)
    cached = make_request("cached", list(range(8)))
    admit(kv, cached)
    kv.free(cached)
    first = Request("first", list(range(100, 110)), SamplingParams(max_tokens=100))
    assert admit(kv, first) == [2, 3, 4, 5, 6, 7]
    return kv, first


def test_blocks_ahead_come_only_from_the_empty_half_of_the_pool(make_kv_cache_manager):
    kv, first = _first_request_past_a_cached_prefix(make_kv_cache_manager)
    params = SamplingParams(max_tokens=100)
    second = Request("second", list(range(200, 210)), params)
    assert admit(kv, second) == [8, 9, 10]  # none to spare: exactly what it needs
    # The cached prefix was never evicted for blocks ahead.
    assert kv.get_computed_blocks(make_request("again", list(range(9)))) == ([0, 1], 8)
    kv.free(first)
    kv.free(second)


def test_blocks_held_ahead_go_back_before_a_prefix_is_evicted_or_an_allocation_refused(make_kv_cache_manager):
    kv, first = _first_request_past_a_cached_prefix(make_kv_cache_manager)  # 3 needed, 3 ahead
    params = SamplingParams(max_tokens=100)
    # Held ahead, they count as free: usage is what requests' tokens fill.
    assert kv.block_pool.num_free_blocks == 10 and kv.num_free_blocks == 13
    assert kv.usage == pytest.approx(3 / 16)
    second = Request("second", list(range(200, 236)), params)  # 9 blocks: 8 empty, 1 taken back
    assert admit(kv, second) == [7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert kv.get_block_ids("first") == [2, 3, 4, 5, 6]
    assert kv.get_computed_blocks(make_request("again", list(range(9)))) == ([0, 1], 8)  # not evicted
    third = Request("third", list(range(300, 316)), params)  # 4 blocks: first's 2 ahead, then the prefix
    assert admit(kv, third) == [0, 1, 5, 6]
    assert kv.get_block_ids("first") == [2, 3, 4] and kv.num_free_blocks == 0
    first.append_output_token_ids([7, 7, 7])  # its 4th block: none free, none held ahead
    assert kv.allocate_slots(first, 3) is None and kv.get_block_ids("first") == [2, 3, 4]
    for request in (first, second, third):
        kv.free(request)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "admit", "grow", "grow", "free", "reset"]), st.integers(0, 5),
                          st.integers(1, 24)), min_size=5, max_size=60))
def test_blocks_ahead_refuse_no_allocation_and_evict_no_prefix_that_one_at_a_time_would_not(operations):
    """The same requests through a pool that takes blocks one at a time and one that takes
    up to 7 ahead: every allocation succeeds in one exactly where it does in the other,
    the same prefixes stay cached, and as many blocks are free (held ahead counting free)."""
    from common.engine.kv_cache_manager import KVCacheManager
    managers = [KVCacheManager(16, BLOCK_SIZE, True, True, num_blocks_ahead) for num_blocks_ahead in (0, 7)]
    live: dict[str, list[Request]] = {}  # each request, once per manager

    def allocate(requests: list[Request], num_new_tokens, hit_block_ids=((), ())) -> bool:
        new_block_ids = [kv.allocate_slots(r, num_new_tokens(r), hits)
                         for kv, r, hits in zip(managers, requests, hit_block_ids)]
        assert [ids is None for ids in new_block_ids] == [new_block_ids[0] is None] * 2
        for request in requests:
            request.num_computed_tokens = request.num_tokens
        return new_block_ids[0] is not None

    for number, (operation, choice, length) in enumerate(operations):
        if operation == "admit":
            prompt = [choice] * 4 + list(range(number * 100, number * 100 + length))
            requests = [Request(f"r{number}", prompt, SamplingParams(max_tokens=4 * length)) for _ in managers]
            hits = [kv.get_computed_blocks(r) for kv, r in zip(managers, requests)]
            assert hits[0][1] == hits[1][1]  # as many tokens hit (the block ids differ)
            if allocate(requests, lambda r, n=hits[0][1]: r.num_tokens - n, [ids for ids, _ in hits]):
                live[requests[0].req_id] = requests
        elif operation == "grow" and live:
            req_id = sorted(live)[choice % len(live)]
            requests = live[req_id]
            for request in requests:
                request.append_output_token_ids([7] * (length % 8 + 1))
            if not allocate(requests, lambda r: r.num_tokens - r.num_computed_tokens):
                for kv, request in zip(managers, live.pop(req_id)):  # the scheduler preempts it
                    kv.free(request)
        elif operation == "free" and live:
            for kv, request in zip(managers, live.pop(sorted(live)[choice % len(live)])):
                kv.free(request)
        elif operation == "reset":
            for kv in managers:
                kv.reset_prefix_cache()
        for kv in managers:
            kv.check_invariants()
        assert managers[0].num_free_blocks == managers[1].num_free_blocks
        assert sorted(managers[0].all_cached_block_hashes()) == sorted(managers[1].all_cached_block_hashes())
    assert managers[0].num_blocks_held_ahead == 0


def test_embeddings_take_no_blocks_ahead_and_an_imported_prompt_takes_them_as_any(make_kv_cache_manager):
    from common.engine.pooling_params import PoolingParams
    kv = make_kv_cache_manager(num_blocks=64, num_blocks_ahead=3)
    imported = Request("imported", list(range(10)), SamplingParams(max_tokens=100))
    imported.kv_transfer_params = {"transfer_id": "t1", "timeout_s": 5.0}
    # Its connector receives into the prompt's three blocks alone (test_kv_connector_scheduler.py).
    assert kv.allocate_slots(imported, 10, [], delay_cache_blocks=True) == [0, 1, 2, 3, 4, 5]
    imported.num_computed_tokens = 10
    assert _decode_to(kv, imported, 24) == []  # its output fills blocks it already holds
    embedding = Request.embedding("embedding", list(range(50, 60)), PoolingParams())
    assert admit(kv, embedding) == [6, 7, 8]
    kv.free(imported)
    kv.free(embedding)
