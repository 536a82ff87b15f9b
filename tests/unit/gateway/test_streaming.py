"""The gateway in-process against a real decode process (bundled model, local prefill):
streaming vs unary, detokenization, stop strings and stop tokens, and cancellation
flowing down: a stop string, a client going away or a deadline frees the decode
instance's blocks (checked through its Stats RPC)."""
from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.cli.processes import ManagedProcess
from gateway.client import Client
from protos.pdserve.v1 import common_pb2, decode_pb2_grpc
from tests.support.background_gateway import BackgroundGateway

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("decode_service.main") is None, reason="decode_service not built yet")]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with BackgroundGateway() as gw:
        decode = ManagedProcess("decode-0", [
            "decode", "--gateway", gw.registry_address, "--port", "0", "--instance-id", "decode-0",
            "--kv-cache-memory", "64MiB", "--log-level", "WARNING"],
            log_dir=tmp_path_factory.mktemp("logs"), echo=False)
        try:
            decode.wait_ready(120)
            with Client(gw.address, timeout=60) as client:
                deadline = time.monotonic() + 30
                while client.model_info().num_decode_instances < 1:
                    assert time.monotonic() < deadline, "decode-0 did not register"
                    time.sleep(0.1)
                gw.decode_address, gw.client = decode.address, client
                yield gw
        finally:
            decode.stop()


def wait_until_decode_idle(address: str, timeout_s: float = 10.0) -> common_pb2.InstanceLoad:
    with grpc.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            load = stub.Stats(common_pb2.StatsRequest(), timeout=5).load
            if (load.num_running_requests, load.num_waiting_requests) == (0, 0) and \
                    load.num_free_blocks == load.num_total_blocks:
                return load
            assert time.monotonic() < deadline, f"decode still holds work: {load}"
            time.sleep(0.05)


def test_stream_and_unary_agree_and_text_is_the_decoded_tokens(stack):
    client, tokenizer = stack.client, stack.gateway.model.tokenizer
    whole = client.generate(PROMPT, max_tokens=16, temperature=0, return_token_ids=True, logprobs=2)
    chunks = list(client.generate_stream(PROMPT, max_tokens=16, temperature=0, return_token_ids=True))
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text == tokenizer.decode(whole.token_ids)
    assert whole.finish_reason == chunks[-1].finish_reason and whole.finish_reason in ("stop", "length")
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert whole.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert whole.usage.completion_tokens == len(whole.token_ids) == chunks[-1].usage.completion_tokens
    assert [t for t, _ in whole.logprobs] == whole.token_ids
    assert all(len(lp.top_token_ids) == 2 and lp.token_logprob <= 0 for _, lp in whole.logprobs)
    assert whole.decode_instance_id == "decode-0" and whole.prefill_instance_id == ""


def test_chat_messages_go_through_the_template(stack):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    result = stack.client.generate(messages=messages, max_tokens=12, temperature=0)
    tokenizer = stack.gateway.model.tokenizer
    assert result.usage.prompt_tokens == len(tokenizer.apply_chat_template(messages))
    assert "Paris" in result.text


def test_stop_string_cuts_the_text_and_frees_the_decode(stack):
    client = stack.client
    full = client.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    stop = full.text.split()[2]  # a word that is sure to come
    result = client.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    assert (result.finish_reason, result.stop_string) == ("stop", stop)
    assert result.text == full.text[:full.text.index(stop)]
    assert result.usage.completion_tokens < 24
    with_stop = client.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=True)
    assert with_stop.text == full.text[:full.text.index(stop) + len(stop)]
    wait_until_decode_idle(stack.decode_address)


def test_stop_token_is_reported(stack):
    client = stack.client
    full = client.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True)
    stop_token = full.token_ids[2]
    result = client.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True,
                             stop_token_ids=[stop_token])
    assert (result.finish_reason, result.stop_token_id) == ("stop", stop_token)
    assert result.token_ids == full.token_ids[:full.token_ids.index(stop_token) + 1]
    # the stop token is in token_ids, its text only with include_stop_str_in_output (vLLM's rule)
    tokenizer = stack.gateway.model.tokenizer
    assert result.text == tokenizer.decode(result.token_ids[:-1])
    chunks = list(client.generate_stream(PROMPT, max_tokens=8, temperature=0, ignore_eos=True,
                                         stop_token_ids=[stop_token]))
    assert "".join(c.text for c in chunks) == result.text
    kept = client.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop_token],
                           include_stop_str_in_output=True)
    assert kept.text == tokenizer.decode(result.token_ids)
    # an EOS shown with skip_special_tokens=False: not in the text either
    chat = client.generate(messages=[{"role": "user", "content": "Say hi."}], max_tokens=60, temperature=0,
                           skip_special_tokens=False, return_token_ids=True)
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in tokenizer.eos_token_ids
    assert chat.text == tokenizer.decode(chat.token_ids[:-1], skip_special_tokens=False)
    assert "<|im_end|>" not in chat.text


def test_client_leaving_mid_stream_frees_the_decode(stack):
    stream = stack.client.generate_stream(PROMPT, max_tokens=400, temperature=0, ignore_eos=True)
    for _, chunk in zip(range(3), stream):
        assert chunk.finish_reason is None
    stream.close()  # the client goes away: cancels the gateway call, which cancels Decode
    wait_until_decode_idle(stack.decode_address)


def test_deadline_is_deadline_exceeded_and_frees_the_decode(stack):
    with pytest.raises(grpc.RpcError) as error:
        stack.client.generate(PROMPT, max_tokens=1000, temperature=0, ignore_eos=True, timeout=1.0)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_decode_idle(stack.decode_address)


def test_concurrent_streams_all_complete(stack):
    def run(i: int) -> str:
        chunks = list(stack.client.generate_stream(f"Count to {i}:", max_tokens=12, temperature=0,
                                                   ignore_eos=True))
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
        return "".join(c.text for c in chunks)
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(run, range(8)))
    assert all(texts)
    wait_until_decode_idle(stack.decode_address)
