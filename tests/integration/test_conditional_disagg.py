"""Conditional disaggregation by load on a real stack (gateway, 1 prefill, 1 decode, the
bundled model): with --max-prefill-queue-tokens the gateway sends a prompt to the prefill
instance only while that instance's queue, as placement sees it, is under the limit; past
it the decode instance prefills the prompt itself, and computes an embedding itself. Every
prompt would otherwise go remote (--local-prefill-threshold 0).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

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


def heartbeats(stack: LocalStack) -> float:
    """How many heartbeats of prefill-0 (the prefill pool's one instance) the gateway has
    received after its first."""
    return total(scrape(stack.gateway.metrics_address), "pdserve_heartbeat_gap_seconds_count", pool="prefill")


def placements(stack: LocalStack, result: str) -> float:
    return total(scrape(stack.gateway.metrics_address), "pdserve_placement_decisions_total", pool="prefill",
                 result=result)


@contextlib.contextmanager
def long_prompt_queued(stack: LocalStack, client: Client, first_token_id: int = 1_000) -> Iterator[dict]:
    """While a long prompt (from first_token_id: each test its own, or prefill-0's cache would
    hold it) is queued on prefill-0 past the limit; yields {"long": its result} once the block ends."""
    results = {}
    prompt_token_ids = [first_token_id + token_id - LONG_PROMPT_IDS[0] for token_id in LONG_PROMPT_IDS]
    long_call = threading.Thread(target=lambda: results.update(
        long=client.generate(token_ids=prompt_token_ids, **SAMPLING)))
    long_call.start()
    try:
        # Charged to prefill-0 when placed, and queued there.
        wait_for(lambda: queued_tokens(stack) >= MAX_QUEUED_TOKENS
                 and own_queued_tokens(stack) >= MAX_QUEUED_TOKENS, 60, "the long prompt queued on prefill-0")
        # A heartbeat prefill-0 took before it had the prompt, still on its way, would replace
        # the charge with its 0 once it arrives: the second heartbeat from now was taken after.
        num_heartbeats = heartbeats(stack)
        wait_for(lambda: heartbeats(stack) >= num_heartbeats + 2, 30, "two more heartbeats of prefill-0")
        assert queued_tokens(stack) >= MAX_QUEUED_TOKENS, "prefill-0 was done with the long prompt before the test"
        yield results
    finally:
        long_call.join(timeout=120)


def test_a_prompt_arriving_while_the_prefill_queue_is_full_is_prefilled_by_the_decode_instance(stack):
    with Client(stack.address, timeout=120) as client:
        wait_for(lambda: queued_tokens(stack) == 0, 60, "an idle prefill instance")
        queue_full_before, placed_before = placements(stack, "queue_full"), placements(stack, "placed")
        with long_prompt_queued(stack, client) as results:
            short = client.generate("What is the capital of France?", **SAMPLING)
            assert short.finish_reason == "length" and short.usage.completion_tokens == 4
            assert short.prefill_instance_id == ""  # prefilled by the decode instance
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


def test_an_embedding_arriving_while_the_prefill_queue_is_full_is_computed_by_the_decode_instance(stack):
    text = "Paris is the capital of France."
    with Client(stack.address, timeout=120) as client:
        wait_for(lambda: queued_tokens(stack) == 0, 60, "an idle prefill instance")
        on_prefill = client.embed(text)
        assert on_prefill.instance_id == "prefill-0"
        queue_full_before = placements(stack, "queue_full")
        with long_prompt_queued(stack, client, first_token_id=7_000) as results:
            on_decode = client.embed(text)
            assert on_decode.instance_id == "decode-0"
        assert results["long"].prefill_instance_id == "prefill-0"
        assert placements(stack, "queue_full") - queue_full_before == 1
        assert on_decode.embedding == pytest.approx(on_prefill.embedding, abs=2e-2)  # one model, two engines
        wait_for(lambda: queued_tokens(stack) < MAX_QUEUED_TOKENS, 60, "prefill-0's queue to drain")
        assert client.embed(text).instance_id == "prefill-0"
