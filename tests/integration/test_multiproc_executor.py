"""The mp executor end to end: the bundled model gives the in-process tokens, and a
decode service whose worker process is killed reports NOT_SERVING on gRPC health,
fails its in-flight and new requests with UNAVAILABLE, and leaves no process or
/dev/shm segment behind once stopped."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.engine.cpus import num_cpus_available
from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from common.service.common_api import sampling_params_to_pb
from protos.pdserve.v1 import decode_pb2, decode_pb2_grpc
from protos.serving import DECODE_SERVICE
from tests.integration.test_workers import RegistryServer, ServiceProcess, decode_collect
from tests.unit.common.engine.executor.conftest import alive_pids, existing_segments

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):"]
EXECUTOR_LOG = re.compile(r"executor mp: \d+ worker\(s\), pids \[([\d, ]+)\], shared memory (.*)$", re.M)


def test_bundled_model_gives_the_same_greedy_tokens_in_process_and_in_a_worker(bundled_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    uni = LLM(str(bundled_model_dir), kv_cache_memory="64MiB")
    expected = [o.outputs[0].token_ids for o in uni.generate(PROMPTS, params)]
    del uni
    mp = LLM(str(bundled_model_dir), kv_cache_memory="64MiB", distributed_executor_backend="mp")
    try:
        assert [o.outputs[0].token_ids for o in mp.generate(PROMPTS, params)] == expected
    finally:
        mp.engine.shutdown()


def test_disaggregated_prefill_and_decode_in_worker_processes_give_the_offline_tokens(
        tiny_model_factory, tmp_path):
    """KV connector metadata (sends, receives) and outcomes cross the process boundary."""
    model_dir = tiny_model_factory("tiny-llama-4k", "llama", max_position_embeddings=4096)
    engine = ["--model", str(model_dir), "--distributed-executor-backend", "mp", "--kv-cache-memory", "16MiB",
              "--max-num-batched-tokens", "64"]
    prefill = ServiceProcess("prefill_service.main", ["--instance-id", "prefill-test", *engine],
                             tmp_path / "prefill.log")
    decode = ServiceProcess("decode_service.main", ["--instance-id", "decode-test", "--local-prefill-threshold", "8",
                                                    *engine], tmp_path / "decode.log")
    prompt = list(range(100, 190))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    try:
        deadline = time.monotonic() + 120
        prefill.wait_ready(deadline)
        decode.wait_ready(deadline)
        remote = asyncio.run(decode_collect(decode.address, prompt, params, prefill=prefill.address))
        assert remote["prefill"] == "prefill-test", remote
    finally:
        codes = [prefill.stop(), decode.stop()]
    assert codes == [0, 0], (prefill.log_tail(), decode.log_tail())
    offline = LLM(str(model_dir), kv_cache_memory="16MiB", max_num_batched_tokens=64)
    expected = offline.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    assert remote["token_ids"] == expected


@pytest.mark.parametrize("tensor_parallel_size, pipeline_parallel_size", [(2, 1), (1, 2)])
def test_ranks_split_by_tensor_or_pipeline_give_the_single_rank_tokens(tiny_model_factory, tensor_parallel_size,
                                                                       pipeline_parallel_size, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the ranks take their own share, as in production
    model_dir = tiny_model_factory("tiny-llama", "llama")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # A step budget below the prompts' lengths splits them over batches, so a pipeline has
    # a second batch to run while the first is in flight.
    # Embeddings mean-pooled: every chunk's rows reach the output rank's pooler, in order.
    engine = dict(kv_cache_memory="16MiB", max_num_batched_tokens=8, pooler_config={"pooling_type": "MEAN"})
    single = LLM(str(model_dir), **engine)
    expected = [o.outputs[0].token_ids for o in single.generate(PROMPTS, params)]
    # Prompt logprobs: every rank of the last stage gathers the prompt positions' logits too.
    with_prompt = params.clone(max_tokens=2, prompt_logprobs=2)
    expected_prompt = [o.prompt_logprobs for o in single.generate(PROMPTS, with_prompt)]
    # Embeddings: the output rank pools the last stage's hidden states across the chunks.
    expected_embeddings = [o.outputs.embedding for o in single.embed(PROMPTS)]
    llm = LLM(str(model_dir), **engine, tensor_parallel_size=tensor_parallel_size,
              pipeline_parallel_size=pipeline_parallel_size)
    executor = llm.engine.executor
    pids, segments = executor.worker_pids, executor.shm_names
    submitted = executor.execute_model_async
    overlaps = []

    def submit_checking_overlap(scheduler_output):
        # A request must never be in two batches in flight at once.
        in_flight = {r.req_id for batch, _, _ in llm.engine.batch_queue or () for r in batch.scheduled}
        overlaps.extend(in_flight & {r.req_id for r in scheduler_output.scheduled})
        return submitted(scheduler_output)
    executor.execute_model_async = submit_checking_overlap
    try:
        assert len(pids) == 2 and executor.output_rank == pipeline_parallel_size - 1
        assert executor.collective_rpc("kv_connector_info") == [{}, {}]
        # Each rank an equal share of the CPUs, not every core each (2 ranks: half each).
        assert executor.collective_rpc("num_threads") == [max(1, num_cpus_available() // 2)] * 2
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected
        for got, want in zip([o.prompt_logprobs for o in llm.generate(PROMPTS, with_prompt)], expected_prompt):
            assert len(got) == len(want) and got[0] is None and want[0] is None
            torch.testing.assert_close(torch.tensor([lp.token_logprob for lp in got[1:]]),
                                       torch.tensor([lp.token_logprob for lp in want[1:]]), atol=2e-2, rtol=0)
        for got, want in zip(llm.embed(PROMPTS), expected_embeddings):
            torch.testing.assert_close(torch.tensor(got.outputs.embedding), torch.tensor(want), atol=2e-2, rtol=0)
        # One batch per pipeline stage in flight; one at a time without a pipeline.
        assert llm.engine.max_batches_in_flight == (2 if pipeline_parallel_size == 2 else 0)
        assert overlaps == []
    finally:
        llm.engine.shutdown()
    assert alive_pids(pids) == [] and existing_segments(segments) == []


async def _health(address: str) -> dict[str, int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {name: (await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
                for name in ("", DECODE_SERVICE)}


async def _decode(address: str, request_id: str, max_tokens: int, first: asyncio.Event | None = None) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        num_tokens = 0
        async for response in decode_pb2_grpc.DecodeServiceStub(channel).Decode(decode_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=[1, 2, 3, 4], sampling=sampling_params_to_pb(params))):
            num_tokens += len(response.token_ids)
            if first is not None:
                first.set()
        return num_tokens


def _wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_decode_service_whose_worker_dies_stops_serving_and_fails_requests_unavailable(
        tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("tiny-llama-4k", "llama", max_position_embeddings=4096)
    registry = RegistryServer()
    service = ServiceProcess("decode_service.main",
                             ["--model", str(model_dir), "--distributed-executor-backend", "mp",
                              "--kv-cache-memory", "16MiB", "--grace-period", "2", "--instance-id", "decode-mp",
                              "--gateway", f"127.0.0.1:{registry.port}"], tmp_path / "decode.log")
    try:
        service.wait_ready(time.monotonic() + 120)
        _wait_until(lambda: "decode-mp" in registry.instances(), 20, "never registered with the gateway")
        found = EXECUTOR_LOG.search(service.log_path.read_text())
        assert found, service.log_tail()
        [worker_pid] = [int(pid) for pid in found.group(1).split(",")]
        segments = found.group(2).split()
        assert existing_segments(segments) == segments

        async def main() -> None:
            serving = health_pb2.HealthCheckResponse.SERVING
            assert await _health(service.address) == {"": serving, DECODE_SERVICE: serving}
            started = asyncio.Event()
            in_flight = asyncio.ensure_future(_decode(service.address, "long", 4000, started))
            await asyncio.wait_for(started.wait(), 60)
            os.kill(worker_pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(in_flight, 10)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
            assert "worker rank 0" in failed.value.details()
            deadline = time.monotonic() + 5
            while (status := await _health(service.address)) != {
                    "": health_pb2.HealthCheckResponse.NOT_SERVING,
                    DECODE_SERVICE: health_pb2.HealthCheckResponse.NOT_SERVING}:
                assert time.monotonic() < deadline, status
                await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _decode(service.address, "after", 4)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        asyncio.run(main())
        _wait_until(lambda: "decode-mp" not in registry.instances(), 20, "still registered after the engine died")
    finally:
        exit_code = service.stop()
        registry.close()
    assert exit_code == 0, service.log_tail()
    assert alive_pids([worker_pid]) == []
    assert existing_segments(segments) == []
    assert "leaked shared_memory" not in service.log_path.read_text()
