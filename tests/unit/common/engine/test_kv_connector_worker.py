"""The worker half of the connector over real transports on loopback (ZeroMQ, and Gloo
for torch.distributed): one producer and one consumer, driven only through their
interface and plain metadata, as a model runner drives them."""
from __future__ import annotations

import time

import pytest
import torch

from common.engine.config import KVTransferConfig
from common.engine.kv_connector.factory import make_worker_connector
from common.engine.kv_connector.metadata import KVConnectorMetadata, KVRecvSpec, KVSendSpec
from kv_transfer import KVTarget

NUM_LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 3, 16, (4, 2, 8)
DEADLINE_S = 20.0
pytestmark = pytest.mark.timeout(90)


def pool(seed: int | None):
    """Per layer (K, V), each [NUM_BLOCKS, block_size, num_kv_heads, head_dim]."""
    if seed is None:
        return [(torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE), torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE))
                for _ in range(NUM_LAYERS)]
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(NUM_BLOCKS, *BLOCK_SHAPE, generator=generator) for _ in range(2))
            for _ in range(NUM_LAYERS)]


BIND_ENDPOINTS = {"zmq": "tcp://127.0.0.1:*", "gloo": "gloo://127.0.0.1:0"}


@pytest.fixture(params=["zmq", "gloo"])
def backend(request) -> str:
    return request.param


@pytest.fixture
def workers(backend):
    made = []

    def make(role: str, kv_caches, layerwise_send: bool = True):
        worker = make_worker_connector(KVTransferConfig(role=role, backend=backend,
                                                        bind_endpoint=BIND_ENDPOINTS[backend],
                                                        layerwise_send=layerwise_send))
        worker.register_kv_caches(kv_caches)
        made.append(worker)
        return worker
    yield make
    for worker in made:
        worker.close()


def target_of(consumer, transfer_id: str, dst_block_ids: list[int], timeout_s: float = 10.0) -> dict:
    info = consumer.info()
    return KVTarget(transfer_id=transfer_id, endpoint=info["endpoint"], dst_block_ids=tuple(dst_block_ids),
                    num_layers=info["num_layers"], dtype=info["dtype"], block_shape=tuple(info["block_shape"]),
                    deadline=time.time() + timeout_s).to_dict()


def wait_finished(worker, num_outcomes: int = 1) -> list:
    """get_finished until num_outcomes transfers are reported, as the runner calls it each step."""
    outcomes = []
    deadline = time.monotonic() + DEADLINE_S
    while len(outcomes) < num_outcomes:
        assert time.monotonic() < deadline, f"only {len(outcomes)} of {num_outcomes} transfers ended"
        outcomes += worker.get_finished()
        time.sleep(0.002)
    return outcomes


def run_step(producer, metadata: KVConnectorMetadata) -> None:
    """What the runner does around one forward pass."""
    producer.start_load_kv(metadata)
    if producer.needs_layer_hook:
        for layer_idx in range(NUM_LAYERS):
            producer.wait_for_layer_load(layer_idx)
            producer.save_kv_layer(layer_idx)
    producer.wait_for_save()


@pytest.mark.parametrize("layerwise_send", [True, False])
def test_a_prompts_kv_moves_between_the_workers(workers, layerwise_send):
    src, dst = pool(0), pool(None)
    producer, consumer = workers("producer", src, layerwise_send), workers("consumer", dst)
    dst_block_ids, src_block_ids = [9, 3, 4], [0, 1, 7]
    consumer.start_load_kv(KVConnectorMetadata(recvs=[KVRecvSpec("r", "t-1", dst_block_ids, 10.0)]))
    run_step(producer, KVConnectorMetadata(sends=[KVSendSpec("r", src_block_ids, target_of(consumer, "t-1",
                                                                                             dst_block_ids))]))
    assert producer.needs_layer_hook is False  # the step's sends are handed over
    [sent], [received] = wait_finished(producer), wait_finished(consumer)
    assert (sent.req_id, sent.direction, sent.state) == ("r", "send", "done")
    assert (received.req_id, received.direction, received.state) == ("r", "recv", "done")
    assert received.received_any and received.num_bytes == sent.num_bytes == 2 * NUM_LAYERS * 3 * 4 * 2 * 8 * 4
    for layer_idx in range(NUM_LAYERS):
        for kv in (0, 1):
            assert torch.equal(dst[layer_idx][kv][dst_block_ids], src[layer_idx][kv][src_block_ids])
    assert producer.get_finished() == [] and consumer.get_finished() == []  # reported once


def test_a_receive_nobody_sends_expires(workers):
    consumer = workers("consumer", pool(None))
    consumer.start_load_kv(KVConnectorMetadata(recvs=[KVRecvSpec("r", "t-2", [1, 2], 0.2)]))
    [outcome] = wait_finished(consumer)
    assert (outcome.req_id, outcome.state, outcome.received_any) == ("r", "expired", False)


def test_an_abort_in_the_metadata_cancels_an_open_receive(workers):
    consumer = workers("consumer", pool(None))
    consumer.start_load_kv(KVConnectorMetadata(recvs=[KVRecvSpec("r", "t-3", [1, 2], 10.0)]))
    consumer.start_load_kv(KVConnectorMetadata(abort_req_ids=["r"], abort_reason={"r": "client went away"}))
    [outcome] = wait_finished(consumer)
    assert outcome.state == "failed" and "client went away" in outcome.reason


def test_a_failed_forward_pass_aborts_the_steps_sends(workers, backend):
    producer, consumer = workers("producer", pool(0)), workers("consumer", pool(None))
    consumer.start_load_kv(KVConnectorMetadata(recvs=[KVRecvSpec("r", "t-4", [5], 2.0)]))
    producer.start_load_kv(KVConnectorMetadata(sends=[KVSendSpec("r", [2], target_of(consumer, "t-4", [5]))]))
    producer.save_kv_layer(0)
    producer.abort_saves("the forward pass failed")
    [sent], [received] = wait_finished(producer), wait_finished(consumer)
    assert sent.state == "failed" and not received.ok
    if backend == "zmq":  # ZeroMQ tells the receiver at once; Gloo's receiver sees its deadline pass
        assert received.state == "failed"


def test_a_target_the_sender_rejects_is_reported_failed(workers):
    producer = workers("producer", pool(0))
    producer.start_load_kv(KVConnectorMetadata(sends=[KVSendSpec("r", [2], {"transfer_id": "t-5"})]))
    producer.wait_for_save()
    [sent] = wait_finished(producer)
    assert (sent.req_id, sent.state) == ("r", "failed")
