"""Requests queued for a busy prefill instance are not failed by their KV transfer's
timeout: it starts when the prefill starts sending (--kv-transfer-timeout), and the wait
for a slot has its own bound (--prefill-queue-timeout). Real processes on loopback."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from tests.integration.test_workers import ServiceProcess, decode_collect, wait_all_blocks_free

# A 1 s transfer timeout that a loaded machine could miss: it runs on its own.
pytestmark = [pytest.mark.slow, pytest.mark.timing]

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
NUM_REQUESTS = 10
TRANSFER_TIMEOUT_S = 1.0


def test_a_queue_at_the_prefill_does_not_expire_the_transfers_behind_it(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("tiny-llama-4k", "llama", max_position_embeddings=4096)
    engine = ["--model", str(model_dir), "--kv-cache-memory", "64MiB", "--num-threads", "1"]
    # One prompt at a time, 8 tokens a step: each 3000-token prompt takes hundreds of
    # steps, so the last of the queue waits several times the transfer timeout.
    prefill = ServiceProcess("prefill_service.main", ["--instance-id", "prefill-test", *engine, "--max-num-seqs", "1",
                                                      "--max-num-batched-tokens", "8"], tmp_path / "prefill.log")
    decodes = {queue_s: ServiceProcess("decode_service.main", [
        "--instance-id", f"decode-q{queue_s}", *engine, "--kv-transfer-timeout", str(TRANSFER_TIMEOUT_S),
        "--prefill-queue-timeout", str(queue_s), "--no-local-fallback"], tmp_path / f"decode-q{queue_s}.log")
        for queue_s in (60, 0)}
    def make_prompts(first: int) -> list[list[int]]:  # distinct per burst: no prefix-cache hits
        return [[first + 13 * i + j % 3000 for j in range(3000)] for i in range(NUM_REQUESTS)]

    async def burst(decode: ServiceProcess, prompts: list[list[int]]) -> tuple[list, float]:
        started = time.monotonic()
        results = await asyncio.gather(*(decode_collect(decode.address, p, GREEDY, prefill=prefill.address)
                                         for p in prompts), return_exceptions=True)
        elapsed = time.monotonic() - started
        await wait_all_blocks_free((prefill, decode), timeout=30)
        return results, elapsed

    try:
        deadline = time.monotonic() + 120
        for service in (prefill, *decodes.values()):
            service.wait_ready(deadline)
        prompts = make_prompts(100)
        queued, queued_s = asyncio.run(asyncio.wait_for(burst(decodes[60], prompts), 120))
        unbounded, _ = asyncio.run(asyncio.wait_for(burst(decodes[0], make_prompts(5000)), 120))
    finally:
        codes = [s.stop() for s in (prefill, *decodes.values())]
    assert codes == [0, 0, 0]
    assert queued_s > 2 * TRANSFER_TIMEOUT_S  # the prefill really was a queue
    errors = [r for r in queued if isinstance(r, BaseException)]
    assert errors == [], errors
    expected = [o.outputs[0].token_ids for o in LLM(str(model_dir), kv_cache_memory="64MiB").generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert [r["token_ids"] for r in queued] == expected
    # Without the queue allowance the transfer's clock runs while the request waits: the
    # requests at the back of the queue expire.
    expired = [r for r in unbounded if isinstance(r, grpc.aio.AioRpcError)
               and r.code() == grpc.StatusCode.DEADLINE_EXCEEDED]
    assert expired, unbounded
