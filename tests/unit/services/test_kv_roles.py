"""The prefill and decode engine roles in one process on a tiny random Llama, with the
real ZeroMQ connector on loopback but no gRPC: KV export/import end to end, and
aborts that must not free blocks while a transfer may still touch them."""
from __future__ import annotations

import time

import pytest

from common import LLM, SamplingParams
from common.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from common.engine.engine_core import EngineCore
from common.engine.request import Request
from common.service.engine_requests import add_request as admit_prefill
from common.service.errors import DuplicateRequestError
from decode_service.admission import Placement, admit, finish_import
from kv_transfer import PoolGeometry
from prefill_service.kv_export import TargetMismatchError, make_export_target
from prefill_service.prefiller import first_token_params

NUM_BLOCKS, BLOCK_SIZE = 64, 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [(i * 7919) % 40000 + 3 for i in range(37)]  # 5 blocks, the last one partial
DEADLINE_S = 10.0


def config(model_dir, role: str, layerwise_send: bool = True, kv_cache_dtype: str = "auto") -> EngineConfig:
    return EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                                                cache_dtype=kv_cache_dtype),
                        scheduler=SchedulerConfig(max_num_batched_tokens=16),  # the prompt takes 3 chunks
                        kv_transfer=KVTransferConfig(role=role, bind_endpoint="tcp://127.0.0.1:*",
                                                     layerwise_send=layerwise_send))


@pytest.fixture
def cores(tiny_llama_dir):
    made = []

    def make(role, layerwise_send: bool = True, kv_cache_dtype: str = "auto"):
        core = EngineCore(config(tiny_llama_dir, role, layerwise_send, kv_cache_dtype))
        core.transfer_outcomes = []
        core.kv_transfer_observers.append(core.transfer_outcomes.append)
        made.append(core)
        return core
    yield make
    for core in made:
        core.shutdown()


def geometry(core) -> PoolGeometry:
    return PoolGeometry.from_dict(core.collective_rpc("kv_connector_info")[0])


def export_to(prefill, endpoint: str, transfer_id: str, dst: list[int], first: int = 0, timeout_s: float = 10.0):
    geo = geometry(prefill)
    return make_export_target(endpoint=endpoint, transfer_id=transfer_id, dst_block_ids=dst,
                              first_block_index=first, num_layers=geo.num_layers, dtype=geo.dtype,
                              block_shape=list(geo.block_shape), timeout_s=timeout_s,
                              num_prompt_tokens=len(PROMPT), geometry=geo)


def run_prefill(prefill, req_id: str, export) -> list[int]:
    request = Request(req_id, PROMPT, first_token_params(PARAMS))
    request.kv_transfer_params = export.kv_transfer_params()
    admit_prefill(prefill, request)
    outputs = []
    while not any(o.finished for o in outputs):
        outputs += prefill.step()
    return outputs[-1].new_token_ids


def step_until_transfer_ended(core, req_id: str, outputs: list | None = None):
    """Step the engine (as its loop would) until req_id's transfer is reported ended."""
    deadline = time.monotonic() + DEADLINE_S
    while not any(o.req_id == req_id for o in core.transfer_outcomes):
        assert time.monotonic() < deadline, f"transfer of {req_id} never ended"
        step_outputs = core.step()
        if outputs is not None:
            outputs += step_outputs
        time.sleep(core.idle_wait_s)
    return next(o for o in core.transfer_outcomes if o.req_id == req_id)


def assert_pool_free(core) -> None:
    core.kv_cache_manager.check_invariants()
    assert core.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert not core.scheduler.requests and not core.scheduler.held_requests
    assert not core.has_unfinished_requests()


@pytest.mark.parametrize("layerwise_send, kv_cache_dtype", [(True, "auto"), (False, "auto"), (True, "fp8")])
def test_remote_prefill_then_decode_equals_colocated(cores, tiny_llama_dir, layerwise_send, kv_cache_dtype):
    """fp8: both pools hold E4M3 codes, which travel as they are: the decode continues from
    exactly the codes a colocated engine would have written."""
    prefill = cores("producer", layerwise_send, kv_cache_dtype)
    decode = cores("consumer", kv_cache_dtype=kv_cache_dtype)
    admission = admit(decode, Request("r", PROMPT, PARAMS), True, 0, "t-1", 10.0)
    assert admission.placement is Placement.REMOTE and len(admission.dst_block_ids) == 5
    endpoint = decode.collective_rpc("kv_connector_info")[0]["endpoint"]
    export = export_to(prefill, endpoint, "t-1", admission.dst_block_ids)
    first = run_prefill(prefill, "r", export)
    assert step_until_transfer_ended(prefill, "r").ok
    assert step_until_transfer_ended(decode, "r").ok
    assert_pool_free(prefill)
    outputs = finish_import(decode, "r", first)
    while decode.has_unfinished_requests():
        outputs += decode.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    reference = LLM(model=str(tiny_llama_dir), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                    max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype).generate({"prompt_token_ids": PROMPT},
                                                                                        PARAMS)
    assert tokens == reference[0].outputs[0].token_ids
    assert_pool_free(decode)


def test_constrained_first_token_is_sampled_on_prefill_and_decode_continues_the_grammar(cores, tiny_llama_dir):
    from common.text.tokenizer import load_tokenizer
    choices = ["alpha beta gamma", "zeta", "eta theta"]
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"choice": choices})
    prefill, decode = cores("producer"), cores("consumer")
    admission = admit(decode, Request("c", PROMPT, params), True, 0, "t-c", 10.0)
    endpoint = decode.collective_rpc("kv_connector_info")[0]["endpoint"]
    export = export_to(prefill, endpoint, "t-c", admission.dst_block_ids)
    request = Request("c", PROMPT, first_token_params(params))
    request.kv_transfer_params = export.kv_transfer_params()
    admit_prefill(prefill, request)
    outputs = []
    while not any(o.finished for o in outputs):
        outputs += prefill.step()
    first = outputs[-1].new_token_ids
    tokenizer = load_tokenizer(tiny_llama_dir)
    assert any(choice.startswith(tokenizer.decode(first)) for choice in choices)  # constrained on prefill
    assert step_until_transfer_ended(prefill, "c").ok and step_until_transfer_ended(decode, "c").ok
    outputs = finish_import(decode, "c", first)
    while decode.has_unfinished_requests():
        outputs += decode.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert outputs[-1].finish_reason == "stop" and tokenizer.decode(tokens) in choices
    reference = LLM(model=str(tiny_llama_dir), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                    max_num_batched_tokens=16).generate({"prompt_token_ids": PROMPT}, params)
    assert tokens == reference[0].outputs[0].token_ids
    assert_pool_free(decode)


def test_layers_are_sent_from_within_the_forward_pass_of_the_last_chunk(cores, unused_tcp_port):
    prefill = cores("producer")
    worker_connector = prefill.executor.runner.kv_connector  # a spy on the worker half, test only
    num_layers = geometry(prefill).num_layers
    saved_layers: list[int] = []
    save_kv_layer = worker_connector.save_kv_layer
    worker_connector.save_kv_layer = lambda layer_idx: (saved_layers.append(layer_idx), save_kv_layer(layer_idx))
    export = export_to(prefill, f"tcp://127.0.0.1:{unused_tcp_port}", "t-5", list(range(5)), timeout_s=0.5)
    request = Request("r", PROMPT, first_token_params(PARAMS))
    request.kv_transfer_params = export.kv_transfer_params()
    admit_prefill(prefill, request)
    for _ in range(2):  # partial chunks: the prompt's KV is not final yet
        prefill.step()
        assert saved_layers == []
    assert [o.finish_reason for o in prefill.step()] == ["length"]
    assert saved_layers == list(range(num_layers))
    assert step_until_transfer_ended(prefill, "r").state == "expired"  # nobody listened
    assert_pool_free(prefill)


def test_decode_abort_waits_for_the_receiver_before_freeing(cores):
    decode = cores("consumer")
    admit(decode, Request("r", PROMPT, PARAMS), True, 0, "t-2", 10.0)
    with pytest.raises(DuplicateRequestError):
        admit(decode, Request("r", PROMPT, PARAMS), True, 0, "t-3", 10.0)
    assert decode.abort_requests(["r"]) == []  # deferred: the receiver may still write
    assert decode.kv_cache_manager.num_free_blocks < NUM_BLOCKS
    outputs = []
    assert not step_until_transfer_ended(decode, "r", outputs).ok  # cancelled; no write can follow now
    assert [o.finish_reason for o in outputs] == ["abort"]
    assert_pool_free(decode)


def test_prefill_abort_mid_transfer_keeps_blocks_until_the_sender_lets_go(cores, unused_tcp_port):
    prefill = cores("producer")
    # Nobody listens there: the transfer stays open until it is aborted.
    export = export_to(prefill, f"tcp://127.0.0.1:{unused_tcp_port}", "t-4", list(range(5)))
    run_prefill(prefill, "r", export)
    assert "r" in prefill.scheduler.held_requests
    prefill.abort_requests(["r"])
    assert "r" in prefill.scheduler.held_requests  # still readable by zmq
    assert not step_until_transfer_ended(prefill, "r").ok
    assert_pool_free(prefill)


def test_export_targets_are_checked_before_any_work(cores):
    prefill = cores("producer")
    with pytest.raises(ValueError, match="destination blocks"):
        export_to(prefill, "tcp://127.0.0.1:1", "t", [1, 2])
    with pytest.raises(ValueError, match="first_block_index"):
        export_to(prefill, "tcp://127.0.0.1:1", "t", [1], first=9)
    with pytest.raises(ValueError, match="tcp:// or ipc://"):
        export_to(prefill, "http://x", "t", list(range(5)))
    geo = geometry(prefill)
    with pytest.raises(TargetMismatchError, match="bfloat16"):
        make_export_target(endpoint="tcp://127.0.0.1:1", transfer_id="t", dst_block_ids=list(range(5)),
                           first_block_index=0, num_layers=geo.num_layers, dtype="bfloat16",
                           block_shape=list(geo.block_shape), timeout_s=1, num_prompt_tokens=len(PROMPT),
                           geometry=geo)
    fp8_decode = cores("consumer", kv_cache_dtype="fp8")  # a pool of codes pairs with code pools only
    with pytest.raises(TargetMismatchError, match="float8_e4m3fn"):
        make_export_target(endpoint="tcp://127.0.0.1:1", transfer_id="t", dst_block_ids=list(range(5)),
                           first_block_index=0, num_layers=geo.num_layers, dtype=geometry(fp8_decode).dtype,
                           block_shape=list(geo.block_shape), timeout_s=1, num_prompt_tokens=len(PROMPT),
                           geometry=geo)


def test_first_token_params_keep_what_decides_the_first_token():
    params = SamplingParams(temperature=0.7, seed=3, min_tokens=5, max_tokens=50, logprobs=2, n=1)
    first = first_token_params(params)
    assert (first.max_tokens, first.min_tokens) == (1, 1)  # EOS still masked for the first token
    assert (first.temperature, first.seed, first.logprobs) == (0.7, 3, 2)
    assert first_token_params(SamplingParams(min_tokens=0)).min_tokens == 0


@pytest.fixture
def unused_tcp_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
