"""Maps requests onto KV blocks: allocation, prefix-cache lookup, freeing. No torch.

Block table of a request = the list of block ids it holds, in token order; token i
lives in block_table[i // block_size] at offset i % block_size.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from common.engine.block_hash import compute_block_hashes, root_parent_hash
from common.engine.block_pool import BlockPool, KVCacheBlock, KVCacheEvent
from common.engine.request import Request


@dataclass
class PrefixCacheStats:
    """Counted in tokens, once per admission of a request (see allocate_slots)."""

    num_query_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_kv_events: bool = True, num_blocks_ahead: int = 0):
        self.block_size = block_size
        self.num_blocks_ahead = num_blocks_ahead  # CacheConfig.num_blocks_ahead
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, block_size, enable_kv_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the cache, so
        # later calls only register the blocks that became full since.
        self.num_cached_blocks: dict[str, int] = {}
        # How many leading blocks of each request its tokens (and lookahead slots) have
        # reached; the blocks past them it holds ahead (_num_blocks_ahead), which any
        # allocation the pool alone cannot serve takes back first.
        self.num_needed_blocks: dict[str, int] = {}
        self.num_blocks_held_ahead = 0  # over every request
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can have: the pool's free ones and those held ahead."""
        return self.block_pool.num_free_blocks + self.num_blocks_held_ahead

    @property
    def usage(self) -> float:
        """The share of the pool no allocation can have: blocks that requests' tokens reach
        (free cached blocks and blocks held ahead count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached leading blocks of a request that holds no blocks yet.

        Returns (block ids, number of tokens they cover). At most num_tokens - 1
        tokens are reported: the last token must run through the model to give logits.
        """
        if (not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None
                or (request.pooling_params is not None and request.pooling_params.pools_every_token)):
            return [], 0  # prompt logprobs need every prompt position's logits, such pooling its states
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_block_ids = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_block_ids.append(block.block_id)
        return hit_block_ids, len(hit_block_ids) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_block_ids: Sequence[int] = (),
                       delay_cache_blocks: bool = False, num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make room for num_computed_tokens + cached hits + num_new_tokens tokens, and
        num_lookahead_tokens slots past them that a speculative proposer writes.

        Returns the newly allocated block ids, or None (changing nothing) when the pool
        cannot supply them. Blocks that become full with these tokens are registered
        for prefix caching, unless `delay_cache_blocks` (their KV arrives later, e.g.
        from a remote prefill; call cache_blocks then).
        """
        computed_blocks = [self.block_pool.blocks[block_id] for block_id in new_computed_block_ids]
        req_blocks = self.req_to_blocks.get(request.req_id, [])
        if computed_blocks and req_blocks:
            raise ValueError(f"{request.req_id}: prefix hits are only for a request holding no blocks")
        num_computed_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_total_tokens = num_computed_tokens + num_new_tokens
        num_required_blocks = -(-(num_total_tokens + num_lookahead_tokens) // self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(req_blocks) - len(computed_blocks))
        # Free cached hits are counted in the pool's free blocks but are not available to us.
        num_evictable_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        num_held_ahead = self._num_held_ahead(request.req_id)  # its own: its tokens reach them first
        num_others_ahead = self.num_blocks_held_ahead - num_held_ahead
        if num_new_blocks + num_evictable_hits > self.block_pool.num_free_blocks + num_others_ahead:
            return None
        self.num_blocks_held_ahead -= num_held_ahead  # its own, counted again once it has its blocks
        self.num_needed_blocks[request.req_id] = max(self.num_needed_blocks.get(request.req_id, 0),
                                                     num_required_blocks)
        # Blocks held ahead go back before any cached prefix is evicted, so the cache keeps
        # what it would keep with none held ahead.
        num_short = num_new_blocks - self.block_pool.num_free_empty_blocks
        if num_short > 0 and num_others_ahead:
            self._take_back_blocks_ahead(min(num_short, num_others_ahead), request.req_id)
        if num_new_blocks:
            num_new_blocks += self._num_blocks_ahead(request, num_required_blocks, num_new_blocks)

        if not req_blocks and self.enable_prefix_caching:
            # Counted here, not in get_computed_blocks, so a request that waits at the
            # head of the queue for several steps is counted once.
            self.stats.num_query_tokens += request.num_tokens
            self.stats.num_hit_tokens += len(computed_blocks) * self.block_size
        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.req_id, [])
        req_blocks.extend(computed_blocks)
        req_blocks.extend(new_blocks)
        self.num_blocks_held_ahead += self._num_held_ahead(request.req_id)
        self.num_cached_blocks.setdefault(request.req_id, len(computed_blocks))
        if not delay_cache_blocks:
            self.cache_blocks(request, num_total_tokens)
        return [block.block_id for block in new_blocks]

    def _num_blocks_ahead(self, request: Request, num_required_blocks: int, num_new_blocks: int) -> int:
        """Blocks to take past the num_new_blocks a request needs now (CacheConfig.num_blocks_ahead):
        none that its max_tokens could never fill, none for an embedding request, and only
        empty blocks the pool can spare: more than half of it stays empty afterwards. Should
        the pool run short later, allocate_slots takes them back before it would evict a
        cached prefix or refuse (a waiting or preempted request); until then they lie in a
        run after the request's last block."""
        if self.num_blocks_ahead == 0 or request.pooling_params is not None:
            return 0
        num_blocks_ahead = self.num_blocks_ahead
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:  # None: until EOS or the context's end
            max_blocks = -(-(request.num_prompt_tokens + max_tokens) // self.block_size)
            num_blocks_ahead = min(num_blocks_ahead, max_blocks - num_required_blocks)
        num_spare = self.block_pool.num_free_empty_blocks - num_new_blocks - self.num_blocks // 2
        return max(0, min(num_blocks_ahead, num_spare))

    def _num_held_ahead(self, req_id: str) -> int:
        return len(self.req_to_blocks.get(req_id, ())) - self.num_needed_blocks.get(req_id, 0)

    def _take_back_blocks_ahead(self, num_blocks: int, for_req_id: str) -> None:
        """Return num_blocks held ahead to the pool's empty tier, from the tails of the
        requests holding most first (a request's tokens never reach them this step: they
        lie past its needed blocks)."""
        while num_blocks > 0:  # usually one pass: an allocation is short by a block or two
            req_id = max((r for r in self.req_to_blocks if r != for_req_id), key=self._num_held_ahead)
            num_taken = min(num_blocks, self._num_held_ahead(req_id))
            assert num_taken > 0, f"{num_blocks} more blocks to take back, none held ahead"
            blocks = self.req_to_blocks[req_id]
            taken, blocks[-num_taken:] = blocks[-num_taken:], []
            self.block_pool.free_blocks(reversed(taken))
            self.num_blocks_held_ahead -= num_taken
            num_blocks -= num_taken

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the blocks that are full within the first num_computed_tokens."""
        if not self.enable_prefix_caching:
            return
        self._update_block_hashes(request)
        num_full_blocks = min(num_computed_tokens, request.num_tokens) // self.block_size
        num_cached = self.num_cached_blocks.get(request.req_id, 0)
        if num_full_blocks <= num_cached:
            return
        blocks = self.req_to_blocks[request.req_id]
        self.block_pool.cache_full_blocks(
            blocks[num_cached:num_full_blocks],
            request.block_hashes[num_cached:num_full_blocks],
            parent_block_hash=request.block_hashes[num_cached - 1] if num_cached else None,
            token_ids=request.all_token_ids[num_cached * self.block_size:num_full_blocks * self.block_size])
        self.num_cached_blocks[request.req_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release every block of the request (no-op if it holds none)."""
        self.num_blocks_held_ahead -= self._num_held_ahead(request.req_id)
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self.num_cached_blocks.pop(request.req_id, None)
        self.num_needed_blocks.pop(request.req_id, None)
        # Tail first: a request's last blocks are the least likely to be shared, so
        # they should be evicted before its prefix.
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    @property
    def last_event_seq(self) -> int:
        return self.block_pool.last_event_seq

    def all_cached_block_hashes(self) -> list[int]:
        """Resync snapshot, current as of `last_event_seq` (events drained or not)."""
        return self.block_pool.all_cached_block_hashes()

    def check_invariants(self) -> None:
        pool = self.block_pool
        num_holders: Counter[int] = Counter()
        for req_id, blocks in self.req_to_blocks.items():
            block_ids = [block.block_id for block in blocks]
            assert len(set(block_ids)) == len(block_ids), f"{req_id} holds a block twice: {block_ids}"
            num_holders.update(block_ids)
        free_block_ids = pool.free_block_ids()
        assert len(set(free_block_ids)) == len(free_block_ids), f"a block is free twice: {free_block_ids}"
        free_block_ids = set(free_block_ids)
        for block in pool.blocks:
            assert block.ref_cnt == num_holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {num_holders[block.block_id]} holders")
            assert (block.block_id in free_block_ids) == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, free: {block.block_id in free_block_ids}")
            if block.block_hash is not None:
                assert pool.cached_blocks.get(block.block_hash) is block
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash
        num_held_ahead = [self._num_held_ahead(req_id) for req_id in self.req_to_blocks]
        assert min(num_held_ahead, default=0) >= 0, f"a request holds fewer blocks than it needs: {num_held_ahead}"
        assert sum(num_held_ahead) == self.num_blocks_held_ahead, (
            f"{self.num_blocks_held_ahead} blocks counted held ahead, {sum(num_held_ahead)} held")
        assert self.num_needed_blocks.keys() <= self.req_to_blocks.keys(), "a needed-block count outlived its request"

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to every full block of its tokens, incrementally."""
        num_hashed_tokens = len(request.block_hashes) * self.block_size
        if request.num_tokens - num_hashed_tokens < self.block_size:
            return
        parent_hash = (request.block_hashes[-1] if request.block_hashes
                       else root_parent_hash(request.cache_salt, request.lora_name))
        request.block_hashes.extend(compute_block_hashes(
            request.all_token_ids[num_hashed_tokens:], self.block_size, parent_hash))
