"""MultiProcExecutor at TP 1 on the tiny model: the same tokens as in process, per-rank
RPC results, malformed payloads refused, a killed worker fails the engine within a
second naming its rank, and nothing (process, /dev/shm segment) outlives it."""
from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.engine.async_engine import AsyncEngine
from common.engine.config import KVTransferConfig, SpeculativeConfig, make_engine_config
from common.engine.engine_core import EngineCore
from common.engine.errors import EngineDeadError, ExecutorFailedError
from common.engine.executor import InProcessExecutor
from common.engine.executor.multiproc import (
    MultiProcExecutor,
    WorkerError,
    WorkerRefusedError,
    check_parallel_support,
    output_rank,
)
from common.engine.llm import LLM
from common.engine.outputs import SchedulerOutput
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from tests.unit.common.engine.executor.conftest import alive_pids, existing_segments

REPO_ROOT = Path(__file__).resolve().parents[5]
PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(kv_cache_memory="16MiB", max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("tiny-llama", "llama")


@pytest.fixture(scope="module")
def mp_llm(tiny_dir):
    llm = LLM(str(tiny_dir), distributed_executor_backend="mp", **ENGINE)
    yield llm
    llm.engine.shutdown()


def test_mp_gives_the_in_process_greedy_tokens(tiny_dir, mp_llm):
    uni = LLM(str(tiny_dir), **ENGINE)
    assert isinstance(uni.engine.executor, InProcessExecutor)
    assert isinstance(mp_llm.engine.executor, MultiProcExecutor)
    expected = [o.outputs[0].token_ids for o in uni.generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in mp_llm.generate(PROMPTS, GREEDY)] == expected
    logprobs = GREEDY.clone(logprobs=2)
    assert ([o.outputs[0].logprobs for o in mp_llm.generate(PROMPTS[:1], logprobs)]
            == [o.outputs[0].logprobs for o in uni.generate(PROMPTS[:1], logprobs)])


def test_collective_rpc_returns_one_plain_result_per_rank(mp_llm):
    executor = mp_llm.engine.executor
    assert executor.collective_rpc("kv_connector_info") == [{}]
    free = executor.collective_rpc("free_memory_bytes")
    assert len(free) == 1 and isinstance(free[0], int) and free[0] > 0
    assert executor.device_type == "cpu"
    assert executor.kv_bytes_per_block() == mp_llm.engine.config.cache.block_size * \
        mp_llm.engine.model_config.kv_bytes_per_token(4)


def test_a_pickle_payload_is_refused_and_the_worker_goes_on(mp_llm):
    executor = mp_llm.engine.executor
    [reply] = executor.send_raw(pickle.dumps(SchedulerOutput([], 0)))
    assert not reply["ok"]
    assert "MessageFormatError" in reply["error"] and "looks like a pickle" in reply["error"]
    [reply] = executor.send_raw(b"\x81\xa4kind\xa5evict")  # msgpack {"kind": "evict"}
    assert not reply["ok"] and "kind must be one of" in reply["error"]
    with pytest.raises(RuntimeError, match="worker rank 0: MessageFormatError.*'_run_model' is not a public"):
        executor.collective_rpc("_run_model")
    assert [o.outputs[0].token_ids for o in mp_llm.generate(PROMPTS[:1], GREEDY)][0]


def test_a_call_s_refused_input_is_a_value_error_with_the_worker_s_message(tiny_dir, tmp_path):
    llm = LLM(str(tiny_dir), distributed_executor_backend="mp", enable_lora=True, **ENGINE)
    executor = llm.engine.executor
    try:
        # The adapter's own message, as one process says it: the caller's error, not a worker's failure.
        with pytest.raises(WorkerRefusedError, match=r"^LoRA adapter 'x': no adapter_config.json") as refused:
            executor.collective_rpc("check_lora", ("x", str(tmp_path)))
        assert isinstance(refused.value, ValueError) and "Traceback" not in str(refused.value)
        with pytest.raises(WorkerError, match="worker rank 0: TypeError") as failed:  # any other failure
            executor.collective_rpc("check_lora", ("x", 5))
        assert not isinstance(failed.value, ValueError)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], GREEDY)][0]
    finally:
        llm.engine.shutdown()


def test_a_worker_ignores_ctrl_c_which_is_the_engine_process_to_handle(mp_llm):
    executor = mp_llm.engine.executor
    os.kill(executor.worker_pids[0], signal.SIGINT)
    assert executor.collective_rpc("kv_connector_info") == [{}]
    assert executor.failed is None and alive_pids(executor.worker_pids) == executor.worker_pids


def test_output_rank_is_the_first_rank_of_the_last_pipeline_stage():
    assert output_rank(1, 1) == 0
    assert output_rank(4, 1) == 0
    assert output_rank(2, 3) == 4


@pytest.mark.parametrize("parallel, changes, match", [
    ({"pipeline_parallel_size": 2}, {"speculative": SpeculativeConfig(method="early_exit")},
     "speculative method early_exit is not supported with pipeline parallelism .pipeline_parallel_size 2.: its "
     "draft is the target's own first layers, on the first stage"),
    ({"pipeline_parallel_size": 2}, {"kv_transfer": KVTransferConfig(role="producer")},
     "KV transfer .role producer. is not supported with pipeline parallelism .pipeline_parallel_size 2."),
])
def test_world_size_above_one_refuses_what_is_not_split_yet(parallel, changes, match):
    config = make_engine_config(**parallel, distributed_executor_backend="mp").replace(**changes)
    with pytest.raises(ValueError, match=match):
        check_parallel_support(config)
    check_parallel_support(make_engine_config(distributed_executor_backend="mp").replace(**changes))


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_ranks_may_speculate_with_ngrams_a_draft_model_and_under_tp_an_early_exit(parallel):
    methods = [SpeculativeConfig(method="ngram"), SpeculativeConfig(method="draft_model", draft_model="d")]
    if "tensor_parallel_size" in parallel:
        methods.append(SpeculativeConfig(method="early_exit"))
    for speculative in methods:
        check_parallel_support(make_engine_config(**parallel, distributed_executor_backend="mp")
                               .replace(speculative=speculative))


def test_tensor_parallel_ranks_may_move_kv():
    for role in ("producer", "consumer"):
        check_parallel_support(make_engine_config(tensor_parallel_size=2, distributed_executor_backend="mp")
                               .replace(kv_transfer=KVTransferConfig(role=role)))


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)


def _engine(tiny_dir) -> EngineCore:
    return EngineCore(make_engine_config(str(tiny_dir), distributed_executor_backend="mp", **ENGINE))


def test_a_worker_that_cannot_start_is_named_with_its_exit_code(tiny_dir, tmp_path):
    core_config = make_engine_config(str(tiny_dir), distributed_executor_backend="mp")
    from common.engine.config import ModelConfig
    from common.engine.model_files import load_hf_config
    model_config = ModelConfig.from_hf_config(load_hf_config(tiny_dir))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match=r"worker rank 0 failed to start \(exit code 1\)"):
        MultiProcExecutor(model_config, tmp_path, core_config)
    with pytest.raises(TimeoutError, match="worker rank 0 did not come up within the deadline"):
        MultiProcExecutor(model_config, tiny_dir, core_config, ready_timeout_s=0.05)


@pytest.mark.timing
def test_killing_the_worker_mid_run_fails_every_waiter_within_a_second(tiny_dir):
    core = _engine(tiny_dir)
    executor = core.executor
    pids, segments = executor.worker_pids, executor.shm_names
    engine = AsyncEngine(core)
    deaths: list[BaseException] = []
    engine.death_observers.append(deaths.append)

    async def run() -> float:
        request = Request("long", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        stream = engine.generate(request)
        await stream.__anext__()  # the engine is stepping
        os.kill(pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker rank 0 \(pid \d+\) died with exit code -9"):
            async for _ in stream:
                pass
        waited = time.monotonic() - killed_at
        with pytest.raises(EngineDeadError):
            await engine.call(lambda core: None)
        return waited

    try:
        assert asyncio.run(run()) < 1.0
        assert isinstance(engine.dead, ExecutorFailedError)
        _wait_for(lambda: deaths, 1.0)
        assert deaths == [engine.dead]
    finally:
        engine.shutdown()
    assert alive_pids(pids) == [] and existing_segments(segments) == []


@pytest.mark.timing
def test_killing_an_idle_worker_kills_the_engine_within_a_second(tiny_dir):
    core = _engine(tiny_dir)
    pids, segments = core.executor.worker_pids, core.executor.shm_names
    engine = AsyncEngine(core)
    try:
        os.kill(pids[0], signal.SIGKILL)
        _wait_for(lambda: engine.dead, 1.0)
        assert isinstance(engine.dead, ExecutorFailedError) and "worker rank 0" in str(engine.dead)
    finally:
        engine.shutdown()
    assert alive_pids(pids) == [] and existing_segments(segments) == []


EXIT_WITHOUT_SHUTDOWN = """
import json, sys
from common.engine.llm import LLM
llm = LLM(sys.argv[1], distributed_executor_backend="mp", kv_cache_memory="16MiB")
executor = llm.engine.executor
print(json.dumps({"pids": executor.worker_pids, "segments": executor.shm_names}), flush=True)
"""


def test_nothing_outlives_an_interpreter_that_exits_without_shutdown(tiny_dir):
    done = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_SHUTDOWN, str(tiny_dir)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert done.returncode == 0, done.stderr
    left = json.loads(done.stdout.strip().splitlines()[-1])
    assert alive_pids(left["pids"]) == []
    assert existing_segments(left["segments"]) == []
    assert "leaked shared_memory" not in done.stderr


def test_a_ranks_threads_are_its_share_unless_set(monkeypatch):
    from common.engine.cpus import num_cpus_available
    from common.engine.executor.worker_proc import worker_num_threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = max(1, num_cpus_available() // 4)
    assert worker_num_threads(make_engine_config(tensor_parallel_size=2, pipeline_parallel_size=2,
                                                 device="cpu")) == share
    assert worker_num_threads(make_engine_config(tensor_parallel_size=2, num_threads=3, device="cpu")) == 3
    assert worker_num_threads(make_engine_config(device="cpu", distributed_executor_backend="mp")) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's count, which torch took at import
    assert worker_num_threads(make_engine_config(tensor_parallel_size=2, device="cpu")) is None
