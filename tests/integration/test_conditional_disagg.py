"""Conditional disaggregation by load on a real stack (gateway, 1 prefill, 1 decode, the
bundled model): with --max-prefill-queue-tokens the gateway sends a prompt to the prefill
instance only while that instance's queue, as placement sees it, is under the limit; past
it the decode instance prefills the prompt itself. Every prompt would otherwise go remote
(--local-prefill-threshold 0).
"""
from __future__ import annotations

import threading

import pytest

from common.cli.up import LocalStack
from gateway.client import Client
from tests.support.scrape import scrape, total
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

MAX_QUEUED_TOKENS = 256
# Long enough that the prefill instance (one thread here) is still computing it, seconds
# later, when the next request is placed; short of the bundled model's context.
LONG_PROMPT_IDS = [1_000 + i % 5_000 for i in range(1_800)]
SAMPLING = dict(max_tokens=4, min_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("conditional-disagg-logs")
    with LocalStack(1, 1, passthrough=["--kv-cache-memory", "128MiB", "--log-level", "WARNING",
                                       "--local-prefill-threshold", "0",
                                       "--max-prefill-queue-tokens", str(MAX_QUEUED_TOKENS)],
                    log_dir=log_dir) as local_stack:
        yield local_stack


def queued_tokens(stack: LocalStack) -> float:
    """prefill-0's queue as the gateway's placement sees it."""
    return total(scrape(stack.gateway.metrics_address), "pdserve_instance_estimated_queued_prefill_tokens",
                 instance_id="prefill-0")


def own_queued_tokens(stack: LocalStack) -> float:
    """prefill-0's queue as it reports it (what its heartbeats carry)."""
    return total(scrape(stack.instances["prefill-0"].metrics_address), "pdserve_queued_prefill_tokens")


def placements(stack: LocalStack, result: str) -> float:
    return total(scrape(stack.gateway.metrics_address), "pdserve_placement_decisions_total", pool="prefill",
                 result=result)


def test_a_prompt_arriving_while_the_prefill_queue_is_full_is_prefilled_by_the_decode_instance(stack):
    with Client(stack.address, timeout=120) as client:
        wait_for(lambda: queued_tokens(stack) == 0, 60, "an idle prefill instance")
        queue_full_before, placed_before = placements(stack, "queue_full"), placements(stack, "placed")
        results = {}
        long_call = threading.Thread(target=lambda: results.update(
            long=client.generate(token_ids=LONG_PROMPT_IDS, **SAMPLING)))
        long_call.start()
        try:
            # Charged to prefill-0 when placed, and queued there: a heartbeat from now on
            # reports it too (one sent before prefill-0 had it would clear the charge).
            wait_for(lambda: queued_tokens(stack) >= MAX_QUEUED_TOKENS
                     and own_queued_tokens(stack) >= MAX_QUEUED_TOKENS, 60, "the long prompt queued on prefill-0")
            short = client.generate("What is the capital of France?", **SAMPLING)
            assert short.finish_reason == "length" and short.usage.completion_tokens == 4
            assert short.prefill_instance_id == ""  # prefilled by the decode instance
        finally:
            long_call.join(timeout=120)
        assert results["long"].prefill_instance_id == "prefill-0"
        assert results["long"].usage.completion_tokens == 4
        assert placements(stack, "queue_full") - queue_full_before == 1
        assert placements(stack, "placed") - placed_before == 1

        # Its prefill done (first token back), the queue is empty again: remote once more.
        wait_for(lambda: queued_tokens(stack) < MAX_QUEUED_TOKENS, 60, "prefill-0's queue to drain")
        again = client.generate("What is the capital of France?", **SAMPLING)
        assert again.prefill_instance_id == "prefill-0"
        assert placements(stack, "placed") - placed_before == 2


def test_a_prompt_longer_than_the_limit_still_goes_to_an_idle_prefill_instance(stack):
    with Client(stack.address, timeout=120) as client:
        wait_for(lambda: queued_tokens(stack) < MAX_QUEUED_TOKENS, 60, "prefill-0's queue to drain")
        result = client.generate(token_ids=LONG_PROMPT_IDS[:600], **SAMPLING)
    assert result.prefill_instance_id == "prefill-0" and result.usage.completion_tokens == 4
