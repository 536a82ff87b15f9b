"""A prefill instance dies mid-transfer: the decode instance drops the partial KV and
recomputes the prompt itself, within the request; real processes on loopback."""
from __future__ import annotations

import asyncio
import time

import pytest

from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import decode_pb2_grpc
from tests.integration.test_workers import ServiceProcess, decode_collect, stats

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


async def wait_for_free_blocks(address: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        load = (await stats(address, decode_pb2_grpc.DecodeServiceStub)).load
        if load.num_free_blocks == load.num_total_blocks and not load.num_running_requests:
            return
        assert time.monotonic() < deadline, f"blocks still held: {load}"
        await asyncio.sleep(0.05)


def test_prefill_killed_mid_transfer_is_recomputed_locally(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("tiny-llama", "llama")
    prompt = list(range(100, 164))  # 4 blocks: the dying prefill sends their first layer, then dies
    decode = ServiceProcess("decode_service.main", [
        "--instance-id", "decode-test", "--model", str(model_dir), "--kv-cache-memory", "16MiB",
        "--local-prefill-threshold", "8", "--num-threads", "1", "--log-level", "DEBUG"], tmp_path / "decode.log")
    dying = ServiceProcess("tests.integration.dying_prefill", [str(tmp_path / "decode.log")], tmp_path / "dying.log")
    try:
        deadline = time.monotonic() + 120
        decode.wait_ready(deadline)
        dying.wait_ready(deadline)
        result = asyncio.run(asyncio.wait_for(
            decode_collect(decode.address, prompt, GREEDY, prefill=dying.address), 60))
        assert dying.proc.wait(10) != 0  # it really died
        asyncio.run(wait_for_free_blocks(decode.address))
    finally:
        assert decode.stop() == 0, decode.log_tail()
        dying.stop()
    assert "after part of its KV arrived: prefilling" in decode.log_path.read_text(), decode.log_tail()
    expected = LLM(str(model_dir), kv_cache_memory="16MiB").generate({"prompt_token_ids": prompt}, GREEDY)
    assert result["token_ids"] == expected[0].outputs[0].token_ids, result
    assert result["prefill"] != "dying-prefill", result  # prefilled here
