"""Gateway replicas as real processes: two gateways, one prefill and one decode instance on
the bundled model (LocalStack(num_gateways=2)); every instance registers with both
gateways (`--gateway A,B`).

Both gateways place requests on both instances; an instance given the gateways by name
registers with both and leaves both on SIGTERM; SIGKILL one gateway while streams run
through both, and the survivor's streams all finish while the dead one's fail, and the
instances free what the dead gateway's requests held; restart the killed gateway on its
ports and the instances register with it again on their own. Tests run in file order.
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.cli.processes import ManagedProcess
from common.cli.up import LocalStack
from common.engine.sampling_params import SamplingParams
from gateway.client import Client
from protos.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

pytestmark = pytest.mark.slow

# Longer than decode's 64-token local-prefill threshold: computed on the prefill instance.
LONG_PROMPT = ("Here is a list of facts about the solar system. " + " ".join(
    f"Planet {i} is {name}, which has {moons} known moons." for i, (name, moons) in enumerate(
        [("Mercury", 0), ("Venus", 0), ("Earth", 1), ("Mars", 2), ("Jupiter", 95), ("Saturn", 146)]))
    + " Question: which planet has the most moons? Answer:")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
KILLED, SURVIVOR = 0, 1


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("gateway-replicas-logs")
    with LocalStack(1, 1, num_gateways=2, log_dir=log_dir,
                    passthrough=["--kv-cache-memory", "256MiB", "--log-level", "WARNING",
                                 "--heartbeat-timeout", "3"]) as local_stack:
        yield local_stack


def prompt(tag: str) -> str:
    return f"[{tag}] {LONG_PROMPT}"


def instance_load(stack: LocalStack, name: str) -> common_pb2.InstanceLoad:
    stub_class = prefill_pb2_grpc.PrefillServiceStub if name.startswith("prefill") \
        else decode_pb2_grpc.DecodeServiceStub
    with grpc.insecure_channel(stack.instances[name].address) as channel:
        return stub_class(channel).Stats(common_pb2.StatsRequest(), timeout=5).load


def wait_until_idle(stack: LocalStack, timeout_s: float = 30.0) -> None:
    """Every instance runs nothing and holds no block (cached ones count as free)."""
    deadline = time.monotonic() + timeout_s
    for name in stack.instances:
        while True:
            load = instance_load(stack, name)
            if (load.num_running_requests, load.num_waiting_requests) == (0, 0) \
                    and load.num_free_blocks == load.num_total_blocks:
                break
            assert time.monotonic() < deadline, f"{name} still holds work: {load}"
            time.sleep(0.1)


class Stream:
    """One streamed Generate on its own thread: `started` once its first token arrived;
    then either `chunks` end with a finish reason or `error` holds the RPC's failure."""

    def __init__(self, address: str, text: str, max_tokens: int):
        self.client = Client(address, timeout=180)
        self.call = self.client.generate_stream(text, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.chunks: list = []
        self.error: grpc.RpcError | None = None
        self.started, self.ended = threading.Event(), threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for chunk in self.call:
                self.chunks.append(chunk)
                self.started.set()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.started.set()
            self.ended.set()
            self.client.close()


def test_both_gateways_place_requests_on_both_instances(stack):
    assert stack.registry_address.count(",") == 1
    results = []
    for index, address in enumerate(stack.addresses):
        with Client(address, timeout=120) as client:
            info = client.model_info(timeout=10)
            assert (info.num_prefill_instances, info.num_decode_instances) == (1, 1), index
            # A prompt of its own: a repeated one would hit decode's own prefix cache and
            # be prefilled there.
            results.append(client.generate(prompt(f"both {index}"), sampling=GREEDY))
    for result in results:
        assert (result.prefill_instance_id, result.decode_instance_id) == ("prefill-0", "decode-0")
        assert result.finish_reason == "length" and result.usage.completion_tokens == GREEDY.max_tokens


def gateway_counts(stack: LocalStack) -> list[tuple[int, int]]:
    """(prefill, decode) instances each gateway counts."""
    counts = []
    for address in stack.addresses:
        with Client(address) as client:
            info = client.model_info(timeout=10)
            counts.append((info.num_prefill_instances, info.num_decode_instances))
    return counts


def test_an_instance_given_a_name_registers_with_every_gateway_and_leaves_them_all(stack):
    # `localhost:PORT` is a name, resolved (as a headless Service's would be) to its address.
    by_name = ",".join(f"localhost:{g.registry_address.rsplit(':', 1)[1]}" for g in stack.gateways)
    process = ManagedProcess("decode-by-name", ["decode", "--host", "127.0.0.1", "--port", "0",
                                                "--instance-id", "decode-by-name", "--gateway", by_name,
                                                "--kv-cache-memory", "256MiB", "--log-level", "WARNING"],
                             env=stack.env, log_dir=stack.log_dir)
    try:
        process.wait_ready(300)
        stack.wait_registered(1, 2, timeout_s=60)  # every gateway counts it
    finally:
        assert process.stop(grace_s=60) == 0  # SIGTERM: it deregisters from both
    assert gateway_counts(stack) == [(1, 1), (1, 1)]


def test_killing_a_gateway_loses_only_its_own_streams(stack):
    wait_until_idle(stack)
    survivor_streams = [Stream(stack.addresses[SURVIVOR], prompt(f"survivor {i}"), 48) for i in range(3)]
    killed_streams = [Stream(stack.addresses[KILLED], prompt(f"killed {i}"), 400) for i in range(2)]
    for stream in survivor_streams + killed_streams:
        assert stream.started.wait(120), "a stream produced no token"
    assert all(s.error is None for s in survivor_streams + killed_streams)
    assert not any(s.ended.is_set() for s in killed_streams), "the killed gateway's streams ended too soon"

    stack.kill_gateway(KILLED)  # SIGKILL: no drain, no goodbye to the instances

    for stream in killed_streams:
        assert stream.ended.wait(60)
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
    for stream in survivor_streams:
        assert stream.ended.wait(180)
        assert stream.error is None, stream.error
        assert stream.chunks[-1].finish_reason == "length"
        assert stream.chunks[-1].usage.completion_tokens == 48
    # The instances cancel what the dead gateway had asked for and free its blocks.
    wait_until_idle(stack, timeout_s=60)
    with Client(stack.addresses[SURVIVOR], timeout=120) as client:  # and it goes on serving
        after = client.generate(prompt("after the kill"), sampling=GREEDY)
        assert (after.prefill_instance_id, after.decode_instance_id) == ("prefill-0", "decode-0")
        assert client.model_info(timeout=10).num_decode_instances == 1


def test_a_restarted_gateway_gets_the_instances_again(stack):
    killed_at = stack.addresses[KILLED]
    stack.restart_gateway(KILLED)  # the same ports: where the instances keep trying
    assert stack.addresses[KILLED] == killed_at
    stack.wait_registered(1, 1, timeout_s=60, gateways=[KILLED])
    for index, address in enumerate(stack.addresses):
        with Client(address, timeout=120) as client:
            result = client.generate(prompt(f"after the restart {index}"), sampling=GREEDY)
            assert (result.prefill_instance_id, result.decode_instance_id) == ("prefill-0", "decode-0")
            assert result.finish_reason == "length"
