"""The prefill and decode services as real processes on loopback: real gRPC, real
ZeroMQ KV transfer, the bundled model. Outputs must equal the offline engine's,
and every block must come back whatever the client does.

One prefill and one decode process serve the whole module (each loads the model
once); the last test shuts the decode instance down with SIGTERM.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import msgpack
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.service.common_api import sampling_params_to_pb
from gateway.routing.registry import ROLES, InstanceRegistry, RegistryServicer
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, registry_pb2_grpc
from protos.serving import DECODE_SERVICE, PREFILL_SERVICE

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0
# Same engine settings everywhere, so chunk boundaries (and so float rounding) match
# the offline reference: a 64-token budget prefills long prompts in several chunks.
ENGINE_FLAGS = ["--kv-cache-memory", "64MiB", "--max-num-batched-tokens", "64"]
LOCAL_PREFILL_THRESHOLD = 8
NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
LONG_TEXT = " ".join(f"Fact {i}: the {c} box on shelf {i} holds {i * 7 % 13} marbles."
                     for i, c in enumerate(["red", "blue", "green", "amber"] * 5)) + " Summarize:"


class ServiceProcess:
    """A worker started with `python -m MODULE`; READY line fields parsed from stdout."""

    def __init__(self, module: str, args: list[str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO_ROOT,
                                     stdout=subprocess.PIPE, stderr=self._log,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=_die_with_parent)
        self.fields: dict[str, str] = {}
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            text = line.decode(errors="replace").strip()
            if text.startswith("PDSERVE_READY "):
                self.fields = dict(kv.split("=", 1) for kv in text.split()[1:])
                self._ready.set()

    def wait_ready(self, deadline: float) -> None:
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.proc.args} not ready (exit {self.proc.poll()}):\n{self.log_tail()}")

    @property
    def address(self) -> str:
        return self.fields["grpc"]

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class RegistryServer:
    """The gateway's registry service alone, on its own event loop thread."""

    def __init__(self):
        self.registry = InstanceRegistry(heartbeat_interval_s=0.2, heartbeat_timeout_s=60)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self.call(self._start())

    async def _start(self) -> int:
        self.server = grpc.aio.server()
        registry_pb2_grpc.add_RegistryServiceServicer_to_server(RegistryServicer(self.registry), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def instances(self) -> dict:
        async def snapshot():
            return {i.instance_id: i for role in ROLES for i in self.registry.instances(role)}
        return self.call(snapshot())

    def close(self) -> None:
        self.call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def registry():
    server = RegistryServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def services(tmp_path_factory, registry):
    logs = tmp_path_factory.mktemp("worker-logs")
    gateway = ["--gateway", f"127.0.0.1:{registry.port}"]
    prefill = ServiceProcess("prefill_service.main", ["--instance-id", "prefill-test", *gateway, *ENGINE_FLAGS],
                             logs / "prefill.log")
    decode = ServiceProcess("decode_service.main",
                            ["--instance-id", "decode-test", *gateway, "--kv-transfer-timeout", "20",
                             "--local-prefill-threshold", str(LOCAL_PREFILL_THRESHOLD), *ENGINE_FLAGS],
                            logs / "decode.log")
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        prefill.wait_ready(deadline)
        decode.wait_ready(deadline)
        yield prefill, decode
    finally:
        codes = {p.log_path.name: p.stop() for p in (decode, prefill)}
        assert codes == {"decode.log": 0, "prefill.log": 0}, (codes, prefill.log_tail(), decode.log_tail())


@pytest.fixture(scope="module")
def offline():
    """The colocated reference. One torch thread: on a busy 2-core machine, OpenMP's
    two threads on the main thread run ~10x slower than one (the services run their
    engines on a separate thread and do not suffer from it)."""
    import torch

    from common import LLM
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(kv_cache_memory="64MiB", max_num_batched_tokens=64)
    finally:
        torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def prompts(offline) -> dict[str, list[int]]:
    tok = offline.tokenizer
    long = tok.encode(LONG_TEXT)
    # The repeated long prompt must still go remote: its uncached tail (after our
    # own prefix-cache hit) must not be shorter than the local-prefill threshold.
    while (len(long) - 1) % 16 + 1 < LOCAL_PREFILL_THRESHOLD:
        long.append(long[-1])
    return {"long": long, "medium": tok.encode("The three primary colours of light are red, green and blue; "
                                               "mixing them in equal parts gives"),
            "poem": tok.encode("Write a short poem about the sea at night, in the style of Basho:"),
            "planets": tok.encode("List four planets of the solar system and one fact about each:"),
            "short": tok.encode("Hello")}


def offline_tokens(offline, prompt: list[int], params: SamplingParams = GREEDY):
    out = offline.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    return out.token_ids, out.logprobs


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def decode_collect(address: str, prompt: list[int],
                         params: SamplingParams | common_pb2.SamplingParams = GREEDY, *,
                         prefill: str = "", request_id: str | None = None, resumed: list[int] = ()) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        request = decode_pb2.DecodeRequest(
            request_id=request_id or f"req-{time.monotonic_ns()}", prompt_token_ids=prompt,
            sampling=sampling_params_to_pb(params) if isinstance(params, SamplingParams) else params,
            prefill_address=prefill, prefill_instance_id="prefill-test" if prefill else "",
            resumed_token_ids=resumed)
        result = {"token_ids": [], "logprobs": [], "messages": 0}
        async for response in stub.Decode(request):
            result["token_ids"] += response.token_ids
            result["logprobs"] += [lp.logprob for lp in response.logprobs]
            result["messages"] += 1
            result.update(finish_reason=response.finish_reason, prefill=response.prefill_instance_id,
                          decode=response.decode_instance_id, cached=response.num_cached_tokens)
        return result


async def stats(address: str, service) -> common_pb2.StatsResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await service(channel).Stats(common_pb2.StatsRequest(), timeout=5)


async def wait_all_blocks_free(services, timeout: float = 15.0) -> None:
    """Both pools fully free and idle (evictable prefix-cache blocks count as free)."""
    prefill, decode = services
    deadline = time.monotonic() + timeout
    while True:
        loads = [(await stats(prefill.address, prefill_pb2_grpc.PrefillServiceStub)).load,
                 (await stats(decode.address, decode_pb2_grpc.DecodeServiceStub)).load]
        if all(l.num_free_blocks == l.num_total_blocks and not l.num_running_requests
               and not l.num_waiting_requests for l in loads):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held: {loads}")
        await asyncio.sleep(0.05)


def test_health_serving_and_ready_line(services):
    prefill, decode = services
    assert prefill.fields["instance_id"] == "prefill-test"
    assert prefill.fields["kv_events"].startswith("tcp://127.0.0.1:")
    assert decode.fields["kv"].startswith("tcp://127.0.0.1:")

    async def check():
        for proc, name in ((prefill, PREFILL_SERVICE), (decode, DECODE_SERVICE)):
            async with grpc.aio.insecure_channel(proc.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for service in ("", name):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    run(check())


def test_instances_register_with_the_gateway(services, registry):
    prefill, decode = services
    deadline = time.monotonic() + 20
    while set(instances := registry.instances()) != {"prefill-test", "decode-test"}:
        assert time.monotonic() < deadline, instances
        time.sleep(0.05)
    p, d = instances["prefill-test"].spec, instances["decode-test"].spec
    assert (p.role, p.grpc_address, p.kv_events_endpoint) == ("prefill", prefill.fields["advertise"],
                                                              prefill.fields["kv_events"])
    assert (d.role, d.grpc_address, d.kv_endpoint) == ("decode", decode.fields["advertise"], decode.fields["kv"])
    for spec in (p, d):
        assert spec.block_size == 16 and spec.num_total_blocks > 0 and spec.max_model_len > 0
        assert spec.model_name == "SmolLM2-135M-Instruct"
    while instances["decode-test"].load.num_total_blocks != d.num_total_blocks:  # a heartbeat came
        assert time.monotonic() < deadline
        time.sleep(0.05)
        instances = registry.instances()


def test_prefill_without_target_publishes_kv_events(services, offline):
    """Stored blocks show up on the KV event stream and in the GetCachedBlocks snapshot."""
    prefill, _ = services
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(prefill.fields["kv_events"])

    async def prefill_once(i: int) -> prefill_pb2.PrefillResponse:
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            return await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id=f"events-{i}", prompt_token_ids=[1000 + i] * 40, sampling=sampling_params_to_pb(GREEDY)))

    async def snapshot() -> prefill_pb2.GetCachedBlocksResponse:
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            return await prefill_pb2_grpc.PrefillServiceStub(channel).GetCachedBlocks(
                prefill_pb2.GetCachedBlocksRequest())

    try:
        deadline = time.monotonic() + 20
        for i in range(100):  # a SUB socket misses what is published before it has joined: retry
            response = run(prefill_once(i))
            if sub.poll(2000):
                break
            assert time.monotonic() < deadline, "no KV event message arrived"
        message = msgpack.unpackb(sub.recv())
    finally:
        sub.close()
        context.term()
    assert response.kv_transfer_state == prefill_pb2.KV_TRANSFER_STATE_NOT_REQUESTED
    assert list(response.token_ids) == offline_tokens(offline, [1000 + i] * 40)[0][:1]
    assert message["instance_id"] == "prefill-test"
    stored = [h for e in message["events"] if e["type"] == "stored" for h in e["block_hashes"]]
    assert len(stored) >= 2  # the prompt's two full blocks
    cached = run(snapshot())
    assert set(stored) <= set(cached.block_hashes) and cached.sequence >= message["seq"]


def test_remote_prefill_matches_offline_greedy(services, offline, prompts):
    prefill, decode = services

    async def main():
        before = await stats(prefill.address, prefill_pb2_grpc.PrefillServiceStub)
        first = await asyncio.gather(*(decode_collect(decode.address, prompts[k], prefill=prefill.address)
                                       for k in ("long", "medium")))
        # Again: prefix hits on both sides, so only the tail blocks travel.
        again = await decode_collect(decode.address, prompts["long"], prefill=prefill.address)
        after = await stats(prefill.address, prefill_pb2_grpc.PrefillServiceStub)
        return first + [again], after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens

    results, prefill_hit_tokens = run(main())
    for key, result in zip(("long", "medium", "long"), results):
        tokens, logprobs = offline_tokens(offline, prompts[key])
        assert result["token_ids"] == tokens, key
        assert result["logprobs"] == pytest.approx([lp.token_logprob for lp in logprobs], abs=1e-3)
        assert (result["prefill"], result["decode"]) == ("prefill-test", "decode-test")
        assert result["finish_reason"] == common_pb2.FINISH_REASON_LENGTH
    assert prefill_hit_tokens >= len(prompts["long"]) // 16 * 16 - 16
    assert results[2]["cached"] >= prefill_hit_tokens
    run(wait_all_blocks_free(services))


def test_seeded_sampling_matches_offline(services, offline, prompts):
    prefill, decode = services
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=NUM_TOKENS, ignore_eos=True)
    result = run(decode_collect(decode.address, prompts["poem"], params, prefill=prefill.address))
    assert result["prefill"] == "prefill-test"
    assert result["token_ids"] == offline_tokens(offline, prompts["poem"], params)[0]


def test_local_prefill_paths_match_offline(services, offline, prompts):
    prefill, decode = services
    unreachable = f"127.0.0.1:{free_port()}"

    async def main():
        return await asyncio.gather(
            decode_collect(decode.address, prompts["medium"]),  # no prefill instance named
            decode_collect(decode.address, prompts["short"], prefill=prefill.address),  # under the threshold
            decode_collect(decode.address, prompts["planets"], prefill=unreachable))  # fallback

    for key, result in zip(("medium", "short", "planets"), run(main())):
        assert result["prefill"] == ""  # served locally
        assert result["token_ids"] == offline_tokens(offline, prompts[key])[0], key
    assert "prefill instance prefill-test unreachable" in decode.log_tail(100)
    run(wait_all_blocks_free(services))


def test_cancel_mid_stream_frees_every_block(services, prompts):
    prefill, decode = services

    async def main():
        async with grpc.aio.insecure_channel(decode.address) as channel:
            call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(decode_pb2.DecodeRequest(
                request_id="cancel-mid-stream", prompt_token_ids=prompts["long"][:-5],
                sampling=sampling_params_to_pb(SamplingParams(max_tokens=500, ignore_eos=True)),
                prefill_address=prefill.address))
            received = 0
            async for response in call:
                received += len(response.token_ids)
                if received >= 3:
                    call.cancel()
                    break
        # The same id sent again at once is served once the cancelled one is released,
        # instead of being refused while its abort is still under way.
        again = await decode_collect(decode.address, prompts["long"][:-5],
                                     SamplingParams(max_tokens=4, ignore_eos=True), prefill=prefill.address,
                                     request_id="cancel-mid-stream")
        assert len(again["token_ids"]) == 4, again
        await wait_all_blocks_free(services)
    run(main())


def test_full_pool_is_resource_exhausted_and_cancel_during_prefill_frees(services):
    """A prompt reserving most of the decode pool; a second one finds no room. Then
    the first is cancelled while the prefill instance is still computing it."""
    prefill, decode = services
    big = [(i * 37) % 20000 + 100 for i in range(1300)]

    async def main():
        async with grpc.aio.insecure_channel(decode.address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            first = stub.Decode(decode_pb2.DecodeRequest(
                request_id="big-1", prompt_token_ids=big, sampling=sampling_params_to_pb(GREEDY),
                prefill_address=prefill.address))
            deadline = time.monotonic() + 10
            while not (await stats(decode.address, decode_pb2_grpc.DecodeServiceStub)).load.num_running_requests:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await decode_collect(decode.address, big[1:] + [5], prefill=prefill.address)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "blocks free" in error.value.details()
            prefill_load = (await stats(prefill.address, prefill_pb2_grpc.PrefillServiceStub)).load
            assert prefill_load.num_running_requests + prefill_load.num_waiting_requests == 1  # still prefilling
            first.cancel()
        await wait_all_blocks_free(services)
    run(main())


def test_abort_rpc_ends_the_stream_with_abort(services, prompts):
    prefill, decode = services

    async def main():
        async with grpc.aio.insecure_channel(decode.address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            call = stub.Decode(decode_pb2.DecodeRequest(
                request_id="abort-me", prompt_token_ids=prompts["medium"],
                sampling=sampling_params_to_pb(SamplingParams(max_tokens=500, ignore_eos=True)),
                prefill_address=prefill.address))
            responses = [await call.read()]
            reply = await stub.Abort(decode_pb2.AbortRequest(request_ids=["abort-me", "unknown"]))
            assert reply.num_aborted == 1
            while (response := await call.read()) is not grpc.aio.EOF:
                responses.append(response)
            assert responses[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        await wait_all_blocks_free(services)
    run(main())


def bundled_kv_layout_hash() -> str:
    from common.engine.config import ModelConfig
    from common.engine.kv_connector.layout import kv_layout, kv_layout_hash
    from common.engine.model_files import load_hf_config, resolve_model
    model_config = ModelConfig.from_hf_config(load_hf_config(resolve_model()))
    return kv_layout_hash(kv_layout(model_config, "float32", 16))


def test_prefill_with_unknown_or_unreachable_target_fails_cleanly(services, prompts):
    prefill, decode = services
    prompt = prompts["medium"]
    num_blocks = -(-len(prompt) // 16)

    def target(**changes) -> prefill_pb2.KvTarget:
        fields = dict(kv_endpoint=decode.fields["kv"], transfer_id="never-registered",
                      dst_block_ids=list(range(num_blocks)), first_block_index=0, num_layers=30,
                      dtype="float32", block_shape=[16, 3, 64], timeout_ms=1500,
                      kv_layout_hash=bundled_kv_layout_hash())
        return prefill_pb2.KvTarget(**(fields | changes))

    async def prefill_call(kv_target):
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(prefill_pb2.PrefillRequest(
                    request_id=f"bad-target-{time.monotonic_ns()}", prompt_token_ids=prompt,
                    sampling=sampling_params_to_pb(GREEDY), kv_target=kv_target), timeout=30)
        return error.value.code(), error.value.details()

    async def main():
        # The decode instance drops frames of a transfer it never registered: the target expires.
        code, details = await prefill_call(target())
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "never-registered" in details
        code, _ = await prefill_call(target(kv_endpoint=f"tcp://127.0.0.1:{free_port()}", transfer_id="nobody"))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        code, details = await prefill_call(target(dst_block_ids=list(range(num_blocks + 1))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "destination blocks" in details
        code, details = await prefill_call(target(dtype="bfloat16"))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "bfloat16" in details
        # Same geometry, KV of another meaning (another model config, say): refused before any work.
        code, details = await prefill_call(target(kv_layout_hash="0" * 16))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "KV layout mismatch" in details
        code, details = await prefill_call(target(kv_layout_hash=""))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "missing" in details
        await wait_all_blocks_free(services)
    run(main())


def test_bad_requests_get_invalid_argument(services, registry, prompts):
    prefill, decode = services
    max_model_len = registry.instances()["decode-test"].spec.max_model_len
    cases = [(list(range(100, 2100)), GREEDY, "longer than the maximum model length", []),
             (prompts["short"], common_pb2.SamplingParams(temperature=-1.0), "temperature", []),
             (prompts["short"], common_pb2.SamplingParams(n=2), "n must be 1", []),
             ([10 ** 6], GREEDY, "out of range", []),
             (prompts["short"], GREEDY, "resumed_token_ids[1]: token id 1000000 is out of range", [5, 10 ** 6]),
             (prompts["short"], GREEDY, "leave nothing to generate under max_tokens", [5] * NUM_TOKENS),
             ([100] * (max_model_len - 1), GREEDY, "reach the maximum model length", [5])]

    async def main():
        for prompt, params, message, resumed in cases:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await decode_collect(decode.address, prompt, params, resumed=resumed)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details()
        # Resumed output is computed here with the prompt: never sent to a prefill instance.
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await decode_collect(decode.address, prompts["short"], prefill=prefill.address, resumed=[5])
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prefill_address" in error.value.details()
        await wait_all_blocks_free(services)
    run(main())


def test_a_resumed_request_continues_where_its_output_stops_as_the_engine_would(services, offline, prompts):
    # A request the gateway migrated: prompt and output so far prefilled here, the output
    # counted as output (penalties, per-step seeds, max_tokens) as the offline engine counts it.
    prefill, decode = services
    params = SamplingParams(temperature=0.9, seed=42, frequency_penalty=0.7, presence_penalty=0.4,
                            max_tokens=NUM_TOKENS, ignore_eos=True)
    whole = offline_tokens(offline, prompts["planets"], params)[0]
    num_resumed = 9
    result = run(decode_collect(decode.address, prompts["planets"], params, resumed=whole[:num_resumed]))
    core = offline.engine
    core.add_request(Request("resumed", prompts["planets"], params, output_token_ids=whole[:num_resumed]))
    expected = []
    while core.has_unfinished_requests():
        expected += [t for output in core.step() for t in output.new_token_ids]
    assert result["token_ids"] == expected and len(expected) == NUM_TOKENS - num_resumed
    assert (result["prefill"], result["finish_reason"]) == ("", common_pb2.FINISH_REASON_LENGTH)
    run(wait_all_blocks_free(services))


def test_a_resumed_requests_cached_tokens_count_its_prompt_only(services, offline, prompts):
    # Sent twice, the second finds the prompt and the resumed output's blocks cached; only the
    # prompt's count as cached prompt tokens (the output is no prompt, and usage adds them up).
    prefill, decode = services
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompt = prompts["planets"]
    resumed = offline_tokens(offline, prompt, params)[0][:40]  # past the prompt's last block, whatever its length
    first = run(decode_collect(decode.address, prompt, params, resumed=resumed))
    again = run(decode_collect(decode.address, prompt, params, resumed=resumed))
    assert first["token_ids"] == again["token_ids"] and len(again["token_ids"]) == 48 - 40
    assert len(prompt) // 16 * 16 <= again["cached"] <= len(prompt)
    run(wait_all_blocks_free(services))


def test_sigterm_drains_in_flight_requests_then_exits_zero(services, registry, prompts):
    """Runs last: it shuts the decode instance down."""
    prefill, decode = services

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        in_flight = asyncio.ensure_future(decode_collect(decode.address, prompts["medium"], params,
                                                         prefill=prefill.address))
        while not (await stats(decode.address, decode_pb2_grpc.DecodeServiceStub)).load.num_running_requests:
            await asyncio.sleep(0.02)
        decode.proc.send_signal(signal.SIGTERM)
        async with grpc.aio.insecure_channel(decode.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status \
                    == health_pb2.HealthCheckResponse.SERVING:
                await asyncio.sleep(0.02)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await decode_collect(decode.address, prompts["short"])
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        result = await in_flight
        assert len(result["token_ids"]) == 40 and result["finish_reason"] == common_pb2.FINISH_REASON_LENGTH
    run(main())
    assert decode.proc.wait(30) == 0
    assert "decode-test" not in registry.instances()  # it deregistered on the way out


def _die_with_parent() -> None:
    """SIGTERM the child if pytest dies, so no model-sized process is left behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
