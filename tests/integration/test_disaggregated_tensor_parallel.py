"""Prefill and decode instances of different tensor-parallel sizes, as real processes:
each prefill rank ships the KV heads head_mapping assigns it to the decode ranks that
hold them, and the output equals one engine's."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.engine.config import ModelConfig
from common.engine.kv_connector.layout import kv_layout, kv_layout_hash
from common.engine.llm import LLM
from common.engine.model_files import load_hf_config
from common.engine.sampling_params import SamplingParams
from common.service.common_api import sampling_params_to_pb
from protos.pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from tests.integration.test_workers import ServiceProcess, decode_collect, wait_all_blocks_free

pytestmark = pytest.mark.slow

PROMPTS = [list(range(100, 190)), list(range(300, 341))]  # 6 and 3 blocks of 16; the first is chunked
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def start(module: str, name: str, model_dir, tp: int, tmp_path) -> ServiceProcess:
    args = ["--instance-id", name, "--model", str(model_dir), "--tensor-parallel-size", str(tp),
            "--kv-cache-memory", "16MiB", "--max-num-batched-tokens", "64", "--num-threads", "1"]
    if module == "decode_service.main":
        args += ["--local-prefill-threshold", "8", "--no-local-fallback"]
    return ServiceProcess(module, args, tmp_path / f"{name}.log")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    # 4 query heads and 2 KV heads: TP 2 holds one KV head per rank.
    return tiny_model_factory("tiny-llama", "llama")


@pytest.fixture(scope="module")
def prefill_tp2(model_dir, tmp_path_factory):
    """Both tests' TP 2 prefill instance: each leaves it idle, every block free."""
    prefill = start("prefill_service.main", "prefill-tp2", model_dir, 2, tmp_path_factory.mktemp("prefill-tp2"))
    try:
        yield prefill
    finally:
        assert prefill.stop() == 0, prefill.log_tail()


def test_tp2_prefill_feeds_tp1_decode_and_tp1_prefill_feeds_tp2_decode(model_dir, prefill_tp2, tmp_path):
    pairs = {"tp2-to-tp1": (prefill_tp2, start("decode_service.main", "decode-tp1", model_dir, 1, tmp_path)),
             "tp1-to-tp2": (start("prefill_service.main", "prefill-tp1", model_dir, 1, tmp_path),
                            start("decode_service.main", "decode-tp2", model_dir, 2, tmp_path))}
    services = [s for pair in pairs.values() for s in pair]
    started_here = [s for s in services if s is not prefill_tp2]
    try:
        deadline = time.monotonic() + 180
        for service in services:
            service.wait_ready(deadline)

        async def main():
            results = {}
            for name, (prefill, decode) in pairs.items():
                results[name] = [await decode_collect(decode.address, prompt, GREEDY, prefill=prefill.address)
                                 for prompt in PROMPTS]
                await wait_all_blocks_free((prefill, decode))  # every rank released its blocks
            return results
        results = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        codes = [s.stop() for s in started_here]  # prefill_tp2's exit code: its fixture's teardown
    assert codes == [0] * len(started_here), [s.log_tail() for s in started_here]
    expected = [o.outputs[0].token_ids for o in LLM(str(model_dir), kv_cache_memory="16MiB").generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    for name, outputs in results.items():
        prefill_name = pairs[name][0].fields["instance_id"]
        assert [o["prefill"] for o in outputs] == [prefill_name] * len(PROMPTS), (name, outputs)  # not local
        assert [o["token_ids"] for o in outputs] == expected, name


def test_a_decode_layout_the_prefill_ranks_cannot_map_is_refused_before_any_work(model_dir, prefill_tp2):
    prefill = prefill_tp2
    layout_hash = kv_layout_hash(kv_layout(ModelConfig.from_hf_config(load_hf_config(model_dir)), "float32", 16))
    prompt = PROMPTS[1]

    async def prefill_call(**changes) -> tuple[grpc.StatusCode, str]:
        fields = dict(kv_endpoint="tcp://127.0.0.1:9", transfer_id="t", dst_block_ids=[0, 1, 2],
                      first_block_index=0, num_layers=2, dtype="float32", block_shape=[16, 2, 16],
                      timeout_ms=2000, kv_layout_hash=layout_hash)
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(prefill_pb2.PrefillRequest(
                    request_id=f"bad-{time.monotonic_ns()}", prompt_token_ids=prompt,
                    sampling=sampling_params_to_pb(GREEDY), kv_target=prefill_pb2.KvTarget(**(fields | changes))),
                    timeout=30)
        return error.value.code(), error.value.details()

    async def main():
        # Three decode ranks cannot split two KV heads.
        code, details = await prefill_call(rank_kv_endpoints=[f"tcp://127.0.0.1:{p}" for p in (9, 10, 11)],
                                           block_shape=[16, 1, 16])
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        assert "KV layouts cannot be mapped: 2 KV heads cannot be split over 3" in details
        # Two decode ranks hold one KV head each, not two.
        code, details = await prefill_call(rank_kv_endpoints=["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"])
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "blocks [16, 2, 16]" in details, details
        # One decode rank whose blocks are not the model's.
        code, details = await prefill_call(block_shape=[16, 1, 16])
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "cannot be mapped" in details, details
    prefill.wait_ready(time.monotonic() + 120)
    asyncio.run(asyncio.wait_for(main(), 60))
