"""Fixtures for the KV cache manager and scheduler tests.

Every manager or scheduler built through these factories is checked at teardown:
after everything still held is released, ref counts must match holders and every
block must be back in the free queue.
"""
from __future__ import annotations

import pytest

from common.engine.config import SchedulerConfig
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.scheduler import Scheduler


def _assert_pool_fully_free(kv_cache_manager: KVCacheManager) -> None:
    kv_cache_manager.check_invariants()
    assert kv_cache_manager.num_free_blocks == kv_cache_manager.num_blocks
    assert not kv_cache_manager.req_to_blocks


class _ReqId:
    """Stands in for a Request when the teardown frees leftovers by id."""

    def __init__(self, req_id: str):
        self.req_id = req_id


@pytest.fixture
def make_kv_cache_manager():
    managers: list[KVCacheManager] = []

    def make(num_blocks: int = 8, block_size: int = 4, enable_prefix_caching: bool = True,
             enable_kv_events: bool = True, num_blocks_ahead: int = 0) -> KVCacheManager:
        manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching, enable_kv_events, num_blocks_ahead)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.check_invariants()
        for req_id in list(manager.req_to_blocks):
            manager.free(_ReqId(req_id))
        _assert_pool_fully_free(manager)


@pytest.fixture
def make_scheduler():
    schedulers: list[Scheduler] = []

    def make(num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 8,
             max_num_batched_tokens: int = 64, max_model_len: int = 1024,
             enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
             kv_connector=None, speculative_config=None, num_scheduler_steps: int = 1,
             long_prefill_token_threshold: int = 0, num_blocks_ahead: int = 0) -> Scheduler:
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                                 num_scheduler_steps=num_scheduler_steps,
                                 long_prefill_token_threshold=long_prefill_token_threshold)
        kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching,
                                          num_blocks_ahead=num_blocks_ahead)
        scheduler = Scheduler(config, kv_cache_manager, block_size, max_model_len,
                              kv_connector=kv_connector, speculative_config=speculative_config)
        schedulers.append(scheduler)
        return scheduler

    yield make
    for scheduler in schedulers:
        scheduler.kv_cache_manager.check_invariants()
        scheduler.abort_requests(list(scheduler.requests) + list(scheduler.held_requests))
        assert not (scheduler.requests or scheduler.held_requests or scheduler.running
                    or scheduler.waiting or scheduler.waiting_for_remote_kv)
        _assert_pool_fully_free(scheduler.kv_cache_manager)
