"""The whole system as real processes: `pdserve up --prefill 2 --decode 2` (LocalStack,
the launcher's fixture form) on the bundled model, started once for the module.

Greedy outputs equal the offline LLM's, unary and streamed; 32 concurrent streams
complete; cancellation frees every block on decode and prefill; bad inputs get their
status; instances that die, drain or join mid-run are handled. Tests that kill or add
instances run last, in file order.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.cli.health import check
from common.cli.up import LocalStack
from common.engine.sampling_params import SamplingParams
from gateway.client import AsyncClient, Client, build_generate_request
from protos.pdserve.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc, prefill_pb2_grpc
from gateway.validation import load_served_model
from tests.support.otlp_collector import OtlpCollector
from tests.support.scrape import scrape, total

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
# Long enough (> the decode's 64-token local-prefill threshold) to go to a prefill instance.
LONG_PROMPT = ("Here is a list of facts about the solar system. " + " ".join(
    f"Planet {i} is {name}, which has {moons} known moons." for i, (name, moons) in enumerate(
        [("Mercury", 0), ("Venus", 0), ("Earth", 1), ("Mars", 2), ("Jupiter", 95), ("Saturn", 146)]))
    + " Question: which planet has the most moons? Answer:")
PROMPTS = ["The capital of France is", "def fibonacci(n):", LONG_PROMPT]
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def collector():
    """Where every process of the stack sends its trace spans (common.service.tracing)."""
    with OtlpCollector() as c:
        yield c


@pytest.fixture(scope="module")
def stack(tmp_path_factory, collector):
    log_dir = tmp_path_factory.mktemp("stack-logs")
    # A long worker grace period: draining must finish in-flight requests even on a busy machine.
    with LocalStack(2, 2, passthrough=["--kv-cache-memory", "256MiB", "--log-level", "WARNING",
                                       "--heartbeat-timeout", "3", "--grace-period", "120",
                                       "--otlp-traces-endpoint", collector.endpoint],
                    log_dir=log_dir) as local_stack:
        yield local_stack


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline_outputs():
    from common.engine.llm import LLM
    llm = LLM(num_kv_blocks=128, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params) + llm.chat(CHAT, params)]
    del llm
    return [(o.token_ids, o.text) for o in outputs]


def stats(address: str, role: str) -> common_pb2.StatsResponse:
    stub_class = prefill_pb2_grpc.PrefillServiceStub if role == "prefill" else decode_pb2_grpc.DecodeServiceStub
    with grpc.insecure_channel(address) as channel:
        return stub_class(channel).Stats(common_pb2.StatsRequest(), timeout=5)


def wait_until_idle(stack: LocalStack, timeout_s: float = 15.0) -> None:
    """Every live instance runs nothing and holds no block (cached ones count as free)."""
    deadline = time.monotonic() + timeout_s
    for name, process in stack.instances.items():
        if process.stopping:
            continue
        while True:
            load = stats(process.address, name.split("-")[0]).load
            if (load.num_running_requests, load.num_waiting_requests) == (0, 0) \
                    and load.num_free_blocks == load.num_total_blocks:
                break
            assert time.monotonic() < deadline, f"{name} still holds work: {load}"
            time.sleep(0.1)


def wait_until_the_gateway_sees_no_load(stack: LocalStack, timeout_s: float = 15.0) -> None:
    """Until placement's own estimate of every live instance (the gateway's metrics) holds
    no request and no queued prefill: a heartbeat whose snapshot was taken while a request
    ran can arrive after the gateway saw it finish, and counts it until the next one."""
    live = {name for name, process in stack.instances.items() if not process.stopping}
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(stack.gateway.metrics_address)
        seen = {dict(labels)["instance_id"] for name, labels in samples
                if name == "pdserve_instance_estimated_requests"}
        busy = {(name, dict(labels)["instance_id"]): value for (name, labels), value in samples.items()
                if name in ("pdserve_instance_estimated_requests", "pdserve_instance_estimated_queued_prefill_tokens")
                and value}
        if seen >= live and not busy:
            return
        assert time.monotonic() < deadline, f"the gateway still counts {busy} (instances seen: {seen})"
        time.sleep(0.1)


def served_by(client: Client, role: str, prompts: list[str]) -> set[str]:
    """Who served these prompts, sent concurrently (so the load spreads them)."""
    def run(prompt):
        result = client.generate(prompt, max_tokens=4, temperature=0)
        return result.prefill_instance_id if role == "prefill" else result.decode_instance_id
    with ThreadPoolExecutor(len(prompts)) as pool:
        return set(pool.map(run, prompts))


def unique_long_prompts(tag: str, count: int) -> list[str]:
    return [f"[{tag} {i}] {LONG_PROMPT}" for i in range(count)]


def test_greedy_outputs_equal_the_offline_llm_unary_and_streamed(stack, client, offline_outputs):
    for prompt_kwargs, (token_ids, text) in zip(
            [{"prompt": p} for p in PROMPTS] + [{"messages": CHAT}], offline_outputs):
        unary = client.generate(**prompt_kwargs, max_tokens=MAX_TOKENS, temperature=0, return_token_ids=True)
        chunks = list(client.generate_stream(**prompt_kwargs, max_tokens=MAX_TOKENS, temperature=0,
                                             return_token_ids=True))
        assert unary.token_ids == token_ids and unary.text == text, prompt_kwargs
        assert [t for c in chunks for t in c.token_ids] == token_ids
        assert "".join(c.text for c in chunks) == text
    fresh = unique_long_prompts("remote", 1)[0]
    first = client.generate(fresh, max_tokens=4, temperature=0)
    assert first.prefill_instance_id.startswith("prefill-")  # computed remotely, KV shipped
    wait_until_the_gateway_sees_no_load(stack)
    again = client.generate(fresh, max_tokens=4, temperature=0)
    assert again.usage.cached_prompt_tokens >= 16 * (again.usage.prompt_tokens // 16 - 1), again
    assert again.text == first.text


def test_a_cache_salt_keeps_cached_prompts_to_requests_of_the_same_salt(stack, client):
    fresh = unique_long_prompts("salted", 1)[0]
    first = client.generate(fresh, max_tokens=4, temperature=0, cache_salt="tenant-a")
    assert first.prefill_instance_id.startswith("prefill-") and first.usage.cached_prompt_tokens == 0
    wait_until_the_gateway_sees_no_load(stack)
    for other in ({}, {"cache_salt": "tenant-b"}):  # unsalted, another tenant: neither reads tenant-a's blocks
        miss = client.generate(fresh, max_tokens=4, temperature=0, **other)
        assert miss.usage.cached_prompt_tokens == 0 and miss.text == first.text, (other, miss)
        wait_until_the_gateway_sees_no_load(stack)
    hit = client.generate(fresh, max_tokens=4, temperature=0, cache_salt="tenant-a")
    assert hit.usage.cached_prompt_tokens >= 16 * (hit.usage.prompt_tokens // 16 - 1), hit
    assert hit.text == first.text
    wait_until_the_gateway_sees_no_load(stack)


def test_32_concurrent_streams_complete_across_both_pools(stack):
    prompts = unique_long_prompts("concurrent", 16) + [f"Story number {i}:" for i in range(16)]

    async def run_all():
        async with AsyncClient(stack.address, timeout=180) as aclient:
            async def one(prompt):
                chunks = [c async for c in aclient.generate_stream(prompt, max_tokens=16, temperature=0,
                                                                   ignore_eos=True)]
                return chunks[-1]
            return await asyncio.gather(*(one(p) for p in prompts))
    finals = asyncio.run(run_all())
    assert all(f.finish_reason == "length" and f.usage.completion_tokens == 16 for f in finals)
    assert {f.decode_instance_id for f in finals} == {"decode-0", "decode-1"}
    assert {f.prefill_instance_id for f in finals} >= {"prefill-0", "prefill-1"}
    wait_until_idle(stack)


@pytest.mark.parametrize("when", ["during prefill", "mid-stream"])
def test_cancelling_frees_every_block_on_decode_and_prefill(stack, client, when):
    prompt = f"[cancel {when}] " + LONG_PROMPT * 8  # ~1000 tokens: prefill takes a while
    stream = client.generate_stream(prompt, max_tokens=300, temperature=0, ignore_eos=True)  # sent now
    if when == "mid-stream":
        for _, chunk in zip(range(3), stream):
            assert chunk.finish_reason is None
    else:
        prefills = [p.address for name, p in stack.instances.items() if name.startswith("prefill")]
        deadline = time.monotonic() + 20
        while not any(load.num_running_requests + load.num_waiting_requests
                      for load in (stats(a, "prefill").load for a in prefills)):
            assert time.monotonic() < deadline, "the prompt never reached a prefill instance"
            time.sleep(0.02)
    stream.close()
    wait_until_idle(stack)


def test_every_bad_input_gets_its_status(stack, client):
    info = client.model_info()
    assert (info.num_prefill_instances, info.num_decode_instances) == (2, 2)
    with grpc.insecure_channel(stack.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        cases = [
            (generate_pb2.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT),
            (generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1] * info.max_model_len)),
             grpc.StatusCode.INVALID_ARGUMENT),
            (generate_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(
                max_tokens=info.max_model_len)), grpc.StatusCode.INVALID_ARGUMENT),
            (generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[info.vocab_size])),
             grpc.StatusCode.INVALID_ARGUMENT),
            (generate_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(top_p=2.0)),
             grpc.StatusCode.INVALID_ARGUMENT),
            (generate_pb2.GenerateRequest(text="hi", model="other-model"), grpc.StatusCode.INVALID_ARGUMENT),
            (generate_pb2.GenerateRequest(messages=generate_pb2.ChatMessages()), grpc.StatusCode.INVALID_ARGUMENT),
            (generate_pb2.GenerateRequest(text="x" * (5 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED),
        ]
        for request, code in cases:
            with pytest.raises(grpc.RpcError) as error:
                stub.Generate(request, timeout=30)
            assert error.value.code() == code, (request.WhichOneof("prompt"), error.value.details())
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(generate_pb2.GenerateRequest(text="hi"), timeout=0.001)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    running = client.generate_stream("hi", max_tokens=200, ignore_eos=True, request_id="dup")
    next(running)
    with pytest.raises(grpc.RpcError) as error:
        client.generate("hi", max_tokens=2, request_id="dup")
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
    running.close()
    wait_until_idle(stack)


def test_new_decode_registers_serves_and_drains_with_not_serving(stack, client):
    assert check(stack.address) == "SERVING"
    new = stack.add_instance("decode")  # decode-2; returns once it printed READY
    assert check(new.address) == "SERVING"  # only reachable at all once loaded
    stack.wait_registered(2, 3, timeout_s=30)
    streams = [client.generate_stream(p, max_tokens=40, temperature=0, ignore_eos=True)
               for p in unique_long_prompts("drain", 4)]
    first = [next(s) for s in streams]
    on_new = [s for s, c in zip(streams, first) if c.decode_instance_id == "decode-2"]
    assert on_new, "the new decode instance received no traffic"
    new.signal(15)  # SIGTERM: drain
    deadline = time.monotonic() + 10
    while check(new.address) != "NOT_SERVING":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert all(list(s)[-1].finish_reason == "length" for s in streams)  # in-flight ones finish
    assert new.wait_or_kill(30) == 0
    assert "decode-2" not in served_by(client, "decode", unique_long_prompts("after-drain", 4))


def test_one_trace_follows_a_request_from_the_caller_through_gateway_decode_and_prefill(stack, collector):
    trace_id, caller_span_id = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    with grpc.insecure_channel(stack.address) as channel:
        request = build_generate_request(f"[trace] {LONG_PROMPT}",
                                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                         request_id="req-traced")
        reply = generate_pb2_grpc.GenerateServiceStub(channel).Generate(
            request, timeout=60, metadata=(("traceparent", f"00-{trace_id}-{caller_span_id}-01"),))
    assert reply.prefill_instance_id  # long enough for the prefill pool: three hops

    def hops(spans):
        return {s.name: s for s in spans if s.trace_id == trace_id}
    spans = hops(collector.wait_for(lambda spans: len(hops(spans)) == 3))
    generate, decode, prefill = spans["generate"], spans["decode"], spans["prefill"]
    assert (generate.service, decode.service, prefill.service) == (
        "pdserve-gateway", "pdserve-decode", "pdserve-prefill")
    assert (generate.parent_span_id, decode.parent_span_id, prefill.parent_span_id) == (
        caller_span_id, generate.span_id, decode.span_id)
    assert {s.attributes["gen_ai.request.id"] for s in spans.values()} == {"req-traced"}
    assert generate.attributes["gen_ai.usage.completion_tokens"] == 8
    assert generate.attributes["pdserve.prefill"] == prefill.instance_id == reply.prefill_instance_id
    assert generate.attributes["pdserve.decode"] == decode.instance_id == reply.decode_instance_id
    assert decode.attributes["pdserve.prefilled_by"] == reply.prefill_instance_id
    assert 0 < decode.attributes["pdserve.first_token_s"] < generate.attributes["gen_ai.latency.time_to_first_token"]
    assert prefill.attributes["pdserve.kv_blocks_sent"] > 0
    # The engines' own intervals, under vLLM's names: the prefill's engine computed the prompt,
    # the decode's waited for that KV (queued) and decoded the other 7 tokens.
    assert prefill.attributes["gen_ai.latency.time_in_model_prefill"] > 0
    assert decode.attributes["gen_ai.latency.time_in_model_prefill"] == 0
    assert decode.attributes["gen_ai.latency.time_in_queue"] > 0
    assert decode.attributes["gen_ai.latency.time_in_model_decode"] > 0
    assert not any(s.is_error for s in spans.values())


def test_killed_decode_migrates_its_streams_which_finish_whole_and_is_no_longer_chosen(stack, client):
    streams = [client.generate_stream(p, max_tokens=60, temperature=0, ignore_eos=True, return_token_ids=True)
               for p in unique_long_prompts("kill-decode", 6)]
    firsts = [next(s) for s in streams]
    num_on_killed = [f.decode_instance_id for f in firsts].count("decode-0")
    assert num_on_killed
    tokenizer = load_served_model(None).tokenizer
    stack.kill("decode-0")
    killed_at = time.monotonic()

    def read_whole(stream):  # [(delta, seconds after the kill it arrived)]
        return [(delta, time.monotonic() - killed_at) for delta in stream]

    # Each stream read on a thread of its own, so each delta's arrival time is its own.
    with ThreadPoolExecutor(len(streams)) as pool:
        rests = list(pool.map(read_whole, streams))
    for first, rest in zip(firsts, rests):
        deltas = [first] + [delta for delta, _ in rest]
        if first.decode_instance_id == "decode-0":
            # The death seen and the stream carried on by decode-1: its first delta there. (What
            # the stream has left then takes 52-odd steps of six requests on an eager instance
            # of one thread: 8 s of the Zen 3 EPYC's quiet 9.4 s to the end.)
            moved_at = next(at for delta, at in rest if delta.decode_instance_id == "decode-1")
            assert moved_at < 10
        # Continued on decode-1 after what decode-0 streamed: every token once, the text at the seam whole.
        token_ids = [t for d in deltas for t in d.token_ids]
        assert (deltas[-1].finish_reason, deltas[-1].decode_instance_id, len(token_ids)) == ("length", "decode-1", 60)
        assert deltas[-1].usage.completion_tokens == 60
        assert "".join(d.text for d in deltas) == tokenizer.decode(token_ids)
    assert served_by(client, "decode", unique_long_prompts("after-kill", 4)) == {"decode-1"}
    assert total(scrape(stack.gateway.metrics_address), "pdserve_request_migrations_total") == num_on_killed


def test_killed_prefill_is_dropped_and_a_new_one_receives_traffic(stack, client):
    stack.kill("prefill-0")
    stack_deadline = time.monotonic() + 10  # heartbeat timeout (3 s) plus expiry
    while client.model_info().num_prefill_instances != 1:
        assert time.monotonic() < stack_deadline
        time.sleep(0.2)
    assert served_by(client, "prefill", unique_long_prompts("one-prefill", 4)) <= {"prefill-1", ""}
    stack.add_instance("prefill")  # prefill-2
    stack.wait_registered(2, 1, timeout_s=30)
    assert "prefill-2" in served_by(client, "prefill", unique_long_prompts("new-prefill", 6))
    wait_until_idle(stack)
